"""Today's persons plan seen as the token-budget plan is: the (step, rank) work of a fixed number of persons a rank,
dealt as the reader deals them (:class:`~lifeseq_shards.plan.partition.Partition`: balanced mode, its windows and
their shuffles, each rank's workers in the DataLoader's round robin), for `shardify plan --tokens-per-batch` and
tools/bench_balance.py to set beside :func:`lifeseq_shards.plan.balance.plan_epoch`'s."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .balance import TOKENS, person_cost
from .partition import EVEN, Partition, left_out
from .slots import slot_index


def persons_plan_costs(lengths: np.ndarray, shard_sizes: Sequence[int], world_size: int, num_workers: int,
                       batch_size: int, *, seed: int = 0, epoch: int = 0, window: int = 4096,
                       cost: tuple[float, float] = TOKENS) -> np.ndarray:
    """``cost`` of each (step, rank) batch of the persons plan, shape (steps, ranks).

    Args:
        lengths: each person's length, shards in manifest order then the remainder (as plan_epoch takes them).
        shard_sizes: persons of each shard, all equal but the remainder's, which comes last.
        world_size, num_workers, batch_size, seed, epoch, window: the reader's arrangement and shuffle.
        cost: (a, b) of a len + b len^2.
    """
    part = Partition(tuple(shard_sizes[:-1]), world_size, num_workers, EVEN, seed, True, batch_size, False,
                     window, int(shard_sizes[-1]))
    first = np.concatenate([[0], np.cumsum(shard_sizes)])  # the remainder is shard number len(shard_sizes) - 1
    work = person_cost(np.asarray(lengths), cost)
    ranks = []
    for rank in range(world_size):
        streams = []
        for worker in range(max(1, num_workers)):
            ids = [np.concatenate([np.arange(first[s.shard] + s.start, first[s.shard] + s.stop) for s in win.segments])
                   [order] for win, order in part.ordered_windows(slot_index(rank, worker, num_workers), epoch, 0)]
            mine = work[np.concatenate(ids)] if ids else np.zeros(0)
            streams.append([mine[i : i + batch_size].sum() for i in range(0, len(mine), batch_size)])
        ranks.append(_round_robin(streams))
    return np.array(ranks).T


def persons_left_out(shard_sizes: Sequence[int], world_size: int, num_workers: int) -> int:
    """Persons the persons plan leaves out of each epoch (others each epoch)."""
    return left_out(shard_sizes[:-1], world_size, num_workers, EVEN, int(shard_sizes[-1]))


def _round_robin(streams: list[list[float]]) -> list[float]:
    """The workers' batches in the order an in-order DataLoader returns them (one a message; exhausted ones
    skipped)."""
    out: list[float] = []
    for j in range(max(map(len, streams), default=0)):
        out += [s[j] for s in streams if j < len(s)]
    return out
