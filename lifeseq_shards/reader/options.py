"""What a :class:`~lifeseq_shards.reader.ShardedDataset` reads and how, as one frozen value checked once
(:class:`ReadOptions`). ``ShardedDataset(path, options, **settings)`` takes one (:func:`read_options`); a front end
builds its training loader's once and varies only what differs per loader (the split, the mode, ...). The one
default that needs the manifest (the shuffle window) is resolved where the manifest is read: the dataset's
:class:`~lifeseq_shards.plan.partition.Partition`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from ..deprecation import warn
from ..plan.asked import Asked
from ..plan.balance import BALANCES
from ..plan.epoch import plan_kind
from ..plan.partition import COMPLETE, EVEN, mode_name
from ..store.manifest import Manifest

MAX_WORKERS = 256
PREDICT_SPLITS = ("train", "val")  # what predict embeds by default: every person, remainders included


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """Every ``ShardedDataset`` argument but the root, the world and the manifest (its docstring says what each
    does), checked at construction. ``split`` is kept as given (a loader's state records it so); :attr:`splits` is
    the tuple read. ``skip_files`` becomes a frozenset."""

    split: str | Sequence[str] = "train"
    batch_size: int = 256
    num_workers: int = 0
    mode: str = EVEN
    shuffle: bool | None = None
    seed: int = 0
    drop_last: bool = False
    window: int | None = None
    pad_multiple: int = 8
    pad_to: int | None = None
    packed: bool = False
    skip_files: Collection[str] = frozenset()
    shard_field: bool = False
    tokens_per_batch: int | None = None
    balance: str = "tokens"
    crop: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", mode_name(self.mode))
        object.__setattr__(self, "skip_files", frozenset(self.skip_files))
        if len(self.splits) > 1 and self.mode == EVEN:
            raise ValueError("several splits are read together only in mode='complete' or 'exact' (the shards of "
                             "different splits differ in size)")
        if not 0 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers {self.num_workers} outside 0..{MAX_WORKERS}")
        # refused here, not at the first batch in a worker (pad_to=0 cropped every person to no tokens)
        for name in ("batch_size", "pad_multiple", "pad_to", "window", "tokens_per_batch", "crop"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Integral) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
        if not isinstance(self.seed, Integral) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, not {self.seed!r}")
        if (self.skip_files or self.shard_field) and self.mode != COMPLETE:
            raise ValueError("skip_files and shard_field are for mode='complete' (embedding every person once)")
        refused = plan_kind(self.asked).refusal(self.asked)
        if refused:
            raise ValueError(refused)
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(map(repr, BALANCES))}, not {self.balance!r}")
        if self.packed and self.pad_to is not None:
            raise ValueError("packed batches are padded on the device "
                             "(lifeseq_shards.device.build.padded_fields): no pad_to")

    @property
    def asked(self) -> Asked:
        """How these options ask for an epoch's batches (the plan that forms them: :func:`plan_kind`)."""
        return Asked(self.batch_size, self.tokens_per_batch, self.balance, self.mode, self.drop_last, self.budget_crop)

    @property
    def budget_crop(self) -> int:
        """The most tokens of a person a token budget counts: those the model sees (``crop``, the device's, else
        ``pad_to``, the host's); 0: all of them."""
        return self.crop or self.pad_to or 0

    @property
    def splits(self) -> tuple[str, ...]:
        return (self.split,) if isinstance(self.split, str) else tuple(self.split)

    @property
    def shuffled(self) -> bool:
        """Whether the persons are shuffled: by default in balanced mode, and never in the others."""
        return self.mode == EVEN and (self.shuffle is None or bool(self.shuffle))


def read_options(options: ReadOptions | str | Sequence[str] | None, legacy: tuple[Any, ...],
                 settings: dict[str, Any]) -> ReadOptions:
    """The options of ``ShardedDataset(path, options, *legacy, **settings)``: ``options`` (default
    ``ReadOptions()``) with ``settings`` (its fields by name) replacing what they name. The old form
    ``ShardedDataset(path, split, batch_size, ...)`` (a split where the options stand, a batch size after it) still
    reads as ``split=`` / ``batch_size=``, warning (:class:`~lifeseq_shards.deprecation.LifeSeqDeprecationWarning`)."""
    if options is None or isinstance(options, ReadOptions):
        if legacy:
            raise TypeError("ShardedDataset(path, options=None, *, world=None, manifest=None, **settings) takes no "
                            "positional argument after the options; name them (split=, batch_size=, ...)")
    else:  # the old form: a split where the options stand
        legacy, options = (options, *legacy), None
        if len(legacy) > 2:
            raise TypeError("ShardedDataset(path, split, batch_size) takes no third positional argument (and is "
                            "deprecated): name them all (split=, batch_size=, ...)")
        named = dict(zip(("split", "batch_size")[:len(legacy)], legacy, strict=True))
        twice = sorted(set(named) & set(settings))
        if twice:
            raise TypeError(f"ShardedDataset() got {', '.join(twice)} both by position and by name")
        warn("ShardedDataset(path, " + ", ".join(named) + ", ...) by position",
             "ShardedDataset(path, " + ", ".join(f"{k}=..." for k in named) + ", ...) or ReadOptions", stacklevel=4)
        settings = {**named, **settings}
    return dataclasses.replace(options, **settings) if options is not None else ReadOptions(**settings)


def predict_splits(manifest: Manifest, splits: str | Sequence[str] | None) -> tuple[str, ...]:
    """The splits predict reads: ``splits`` as a tuple, by default those of :data:`PREDICT_SPLITS` the dataset has
    (the DataModule's ``predict_split`` and the embedding writer's default, resolved here only)."""
    if isinstance(splits, str):
        return (splits,)
    return tuple(splits) if splits else tuple(s for s in PREDICT_SPLITS if s in manifest.splits)
