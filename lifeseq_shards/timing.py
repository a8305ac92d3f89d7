"""``shardify time``: how fast this machine reads a dataset, per worker count: the first batch's latency (workers
starting, first shards opened and decoded) and persons and real tokens per second after it, as rank 0 of a world
reads its share with the front ends' host batches (``packed``, as ``LifeSeqDataModule`` and ``LifeSeqData`` get
them, before the device)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from .device.build import packed_views
from .reader import ShardedDataset, ShardedLoader, World
from .store.manifest import Manifest


@dataclass(frozen=True)
class Timing:
    """One pass with ``workers`` workers: ``batches`` read and their ``persons``, the seconds to the first batch,
    and the persons and real tokens of the batches after it with the seconds they took."""

    workers: int
    batches: int
    persons: int
    first_s: float
    rest_persons: int
    rest_tokens: int
    rest_s: float

    def row(self) -> str:
        """A line under :data:`HEADER` (the rates are those after the first batch; n/a with one batch)."""
        def rate(n: int) -> str:
            return f"{n / self.rest_s:,.0f}" if self.rest_s > 0 and self.batches > 1 else "n/a"

        return (f"{self.workers:>7} {self.first_s:>14.2f} {self.batches:>8} {self.persons:>9,} "
                f"{rate(self.rest_persons):>11} {rate(self.rest_tokens):>12}")


HEADER = f"{'workers':>7} {'first batch s':>14} {'batches':>8} {'persons':>9} {'persons/s':>11} {'tokens/s':>12}"


def time_pass(root: str, split: str, batch_size: int, workers: int, world: World, max_batches: int,
              manifest: Manifest | None = None) -> Timing:
    """Read up to ``max_batches`` of epoch 0 of ``split`` as ``world``'s rank with ``workers`` workers, timed. The
    rates count the batches after the first, so the start-up cost is the first column alone. ``manifest``: the
    dataset's, already read (else read here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-balance warning: a timing reads any arrangement
        ds = ShardedDataset(root, split=split, batch_size=batch_size, world=world, num_workers=workers, packed=True,
                            manifest=manifest)
    start = time.perf_counter()
    first_s, batches, persons, first_persons, rest_tokens = 0.0, 0, 0, 0, 0
    for batch in _batches(ShardedLoader(ds, persistent_workers=False), max_batches):
        lengths = packed_views(batch)["lengths"]
        persons, batches = persons + len(lengths), batches + 1
        if batches == 1:
            first_s, first_persons = time.perf_counter() - start, persons
        else:
            rest_tokens += int(lengths.sum())
    rest_s = time.perf_counter() - start - first_s
    return Timing(workers, batches, persons, first_s, persons - first_persons, rest_tokens, rest_s)


def _batches(loader: ShardedLoader, limit: int) -> Iterator[object]:
    """The loader's first ``limit`` batches; its workers end with the pass (not persistent)."""
    for i, batch in enumerate(loader):
        if i == limit:
            return
        yield batch
