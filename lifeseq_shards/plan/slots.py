"""The plan's units: a :class:`Segment` of one shard's persons, the (rank, worker) *slots* that read them
(:func:`num_slots`, :func:`slot_index`), the batches a slot's persons make (:func:`num_batches`), and a stream of
segments cut at places (:func:`_cut`). Pure functions (:mod:`lifeseq_shards.plan.partition` has the partition
itself). """

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

ShardT = TypeVar("ShardT")


@dataclass(frozen=True)
class Segment(Generic[ShardT]):
    """Persons [start, stop) of one shard: here its number (an index into the shard_sizes list the plan was made
    from); the reader swaps in the shard's file."""

    shard: ShardT
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _check_topology(world_size: int, num_workers: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


def num_slots(world_size: int, num_workers: int) -> int:
    """Independent readers: K=0 means the rank's main process reads, which still counts as one slot."""
    _check_topology(world_size, num_workers)
    return world_size * max(num_workers, 1)


def dividing_workers(num_shards: int, world_size: int, most: int = 16) -> list[int]:
    """The worker counts in 1..``most`` whose ``world_size`` x workers readers divide ``num_shards`` shards."""
    return [w for w in range(1, most + 1) if num_shards % (world_size * w) == 0]


def slot_index(rank: int, worker: int, num_workers: int) -> int:
    """Rank-major numbering, so a rank's slots are contiguous: slots [rank*K, (rank+1)*K)."""
    k = max(num_workers, 1)
    if rank < 0 or not 0 <= worker < k:
        raise ValueError(f"rank {rank} / worker {worker} out of range for num_workers={num_workers}")
    return rank * k + worker


def slot_persons(segments: Sequence[Segment[ShardT]]) -> int:
    return sum(seg.size for seg in segments)


def num_batches(persons: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches one slot yields: a slot batches only its own persons, so a short tail batch is per slot."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return persons // batch_size if drop_last else -(-persons // batch_size)


def _cut(segments: Sequence[Segment[int]], lo: int, hi: int) -> list[Segment[int]]:
    """Stream places [lo, hi) of ``segments`` (in reading order) as segments."""
    out, pos = [], 0
    for seg in segments:
        a, b = max(lo, pos), min(hi, pos + seg.size)
        if a < b:
            out.append(Segment(seg.shard, seg.start + a - pos, seg.start + b - pos))
        pos += seg.size
        if pos >= hi:
            break
    return out
