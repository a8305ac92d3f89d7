"""What an epoch plan is asked (:class:`Asked`: how the batches are formed, by a reader's options or by
``shardify plan``'s flags) and for which machines ``shardify plan`` plans (:class:`Topology`); :mod:`.epoch`'s plans
answer them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .partition import EVEN

# a split's persons' lengths and its shards' persons (the remainder shard last), read when a plan calls it
Lengths = Callable[[], tuple[np.ndarray, list[int]]]


@dataclass(frozen=True)
class Asked:
    """How an epoch's batches are asked for: by a reader (``ReadOptions.asked``) or by ``shardify plan``'s flags
    (``batch_size`` None there when it is not given). ``crop``: the most tokens of a person a budget counts (0: all
    of them)."""

    batch_size: int | None
    tokens_per_batch: int | None = None
    balance: str = "tokens"
    mode: str = EVEN
    drop_last: bool = False
    crop: int = 0


@dataclass(frozen=True)
class Topology:
    """The machines ``shardify plan`` plans for: ``nodes`` x ``gpus`` ranks of ``workers`` workers (an
    :class:`~lifeseq_shards.plan.resume.Arrangement` adds how they read: batch size, window, token budget)."""

    nodes: int
    gpus: int
    workers: int
