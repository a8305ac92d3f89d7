"""Partition math for DDP reading: which persons each (rank, worker) slot reads, in which order, and how many batches.

Under DDP with R ranks and K DataLoader workers per rank, N = R * max(K, 1) *slots* read disjoint parts of a split
without talking to each other. Two invariants make this safe:

* every rank yields the same number of batches, otherwise the gradient all-reduce of the longer ranks hangs;
* every person is read at most once per epoch (exactly once in complete mode, for inference, where nothing may be
  dropped).

In balanced mode (training) the shards all hold the same number n of persons, so whole shards dealt round-robin
give every slot the same budget; the S % N shards that do not go round evenly are pooled and cut into N equal
slices, and the few persons that still do not divide (fewer than N) are left out for this epoch only - the shard
order changes with the epoch, so a different tail is left out each time.

Where a resumed pass starts is computed here too: which stream each DataLoader worker plays (``pass_roles``), which
windows of it are loaded (``windows``), the epoch of each pass (``pass_start``) and a saved position
(``resume_point``). Everything here is a pure function of its arguments (no I/O, no global RNG), so all slots compute
the same plan independently and a resumed run recomputes it exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from .deprecation import module_aliases, warn

# balanced: every rank the same number of batches (training, validation); persons that do not divide are left out
# and change with the epoch. complete: every person exactly once (inference); ranks may yield different counts.
BALANCED, COMPLETE = "balanced", "complete"
_OLD_MODES = {"train": BALANCED, "inference": COMPLETE}  # deprecated names, still accepted
# the names a checkpoint's loader layout records: states saved before the rename keep resuming
STORED_MODE = {mode: old for old, mode in _OLD_MODES.items()}
# Constant tags mixed into the RNG seeds so the shard order and the window shuffles never share a stream.
_ORDER_TAG = 0x4F524452  # "ORDR"
_WINDOW_TAG = 0x57494E44  # "WIND"


__getattr__ = module_aliases(__name__, {"TRAIN": "lifeseq_shards.plan:BALANCED",
                                        "INFERENCE": "lifeseq_shards.plan:COMPLETE",
                                        "describe": "lifeseq_shards.plan_report:describe",
                                        "PlanReport": "lifeseq_shards.plan_report:PlanReport"})


def mode_name(mode: str) -> str:
    """``mode`` by its current name; the old names still work, with a DeprecationWarning."""
    if mode in _OLD_MODES:
        warn(f"mode={mode!r}", f"mode={_OLD_MODES[mode]!r}", stacklevel=4)
        return _OLD_MODES[mode]
    if mode not in (BALANCED, COMPLETE):
        raise ValueError(f"mode must be {BALANCED!r} or {COMPLETE!r}, not {mode!r}")
    return mode


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


def slot_index(rank: int, worker: int, num_workers: int) -> int:
    """Rank-major numbering, so a rank's slots are contiguous: slots [rank*K, (rank+1)*K)."""
    k = max(num_workers, 1)
    if rank < 0 or not 0 <= worker < k:
        raise ValueError(f"rank {rank} / worker {worker} out of range for num_workers={num_workers}")
    return rank * k + worker


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(num_shards) that depends only on (seed, epoch), so every slot derives the same one."""
    return np.random.default_rng([seed, epoch, _ORDER_TAG]).permutation(num_shards)


def _train_size(shard_sizes: Sequence[int]) -> int:
    """The common shard size n; training balance relies on it, so unequal sizes are an error, not a warning."""
    if not shard_sizes:
        raise ValueError("balanced mode needs at least one shard")
    sizes = set(shard_sizes)
    if len(sizes) != 1:
        raise ValueError(f"balanced mode needs shards of one size, got sizes {sorted(sizes)}")
    n = sizes.pop()
    if n < 0:
        raise ValueError(f"shard size must be >= 0, got {n}")
    return n


def _pool_slice(pool: Sequence[int], n: int, start: int, stop: int) -> list[Segment[int]]:
    """Pool positions [start, stop) as segments; the pool is the concatenation of shards `pool`, n persons each."""
    segments = []
    pos = start
    while pos < stop:
        i, offset = divmod(pos, n)
        take = min(n - offset, stop - pos)
        segments.append(Segment(int(pool[i]), offset, offset + take))
        pos += take
    return segments


def assign(
    shard_sizes: Sequence[int],
    world_size: int,
    num_workers: int,
    *,
    mode: str,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[list[Segment[int]]]:
    """The segments each slot reads, in reading order; list index = slot_index(rank, worker, num_workers).

    balanced: equal shards; whole shards round-robin, then an equal slice of the pooled tail shards per slot.
    complete: any sizes (the remainder shard last); slot j reads whole shards j, j+N, ... - nothing is dropped,
    slot counts may differ.
    """
    slots = num_slots(world_size, num_workers)
    if mode_name(mode) == COMPLETE:
        if any(size < 0 for size in shard_sizes):
            raise ValueError(f"shard sizes must be >= 0, got {list(shard_sizes)}")
        return [[Segment(s, 0, int(shard_sizes[s])) for s in range(j, len(shard_sizes), slots)] for j in range(slots)]
    n = _train_size(shard_sizes)
    num_shards = len(shard_sizes)
    order = epoch_shard_order(num_shards, seed, epoch) if shuffle else np.arange(num_shards)
    whole = num_shards // slots * slots
    pool = order[whole:]
    q = len(pool) * n // slots
    return [
        [Segment(int(s), 0, n) for s in order[j:whole:slots]] + _pool_slice(pool, n, j * q, (j + 1) * q)
        for j in range(slots)
    ]


def left_out(shard_sizes: Sequence[int], world_size: int, num_workers: int, mode: str) -> int:
    """Persons no slot reads this epoch: (r*n) % N when balanced (always < N), 0 when complete."""
    slots = num_slots(world_size, num_workers)
    if mode_name(mode) == COMPLETE:
        return 0
    n = _train_size(shard_sizes)
    return len(shard_sizes) % slots * n % slots


def slot_persons(segments: Sequence[Segment[ShardT]]) -> int:
    return sum(seg.size for seg in segments)


def num_batches(persons: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches one slot yields: a slot batches only its own persons, so a short tail batch is per slot."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return persons // batch_size if drop_last else -(-persons // batch_size)


def slot_batches(shard_sizes: Sequence[int], world_size: int, num_workers: int, batch_size: int, *, mode: str,
                 drop_last: bool = False) -> list[int]:
    """Batches per slot, every epoch: slot budgets do not depend on the shard order, hence not on seed/epoch."""
    plan = assign(shard_sizes, world_size, num_workers, mode=mode, shuffle=False)
    return [num_batches(slot_persons(segments), batch_size, drop_last) for segments in plan]


def rank_batches(shard_sizes: Sequence[int], world_size: int, num_workers: int, batch_size: int, *, mode: str,
                 drop_last: bool = False) -> list[int]:
    """Batches per rank (sum over its slots)."""
    return sum_per_rank(slot_batches(shard_sizes, world_size, num_workers, batch_size, mode=mode,
                                     drop_last=drop_last), num_workers)


def sum_per_rank(per_slot: list[int], num_workers: int) -> list[int]:
    """Sum per-slot values over each rank's contiguous block of slots."""
    k = max(num_workers, 1)
    return [sum(per_slot[start : start + k]) for start in range(0, len(per_slot), k)]


def window_order(total: int, window: int, seed: int, epoch: int, slot: int, window_index: int) -> np.ndarray:
    """Stream positions of window `window_index`, shuffled; needs nothing from other windows, so resuming is cheap."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    start = window_index * window
    if not 0 <= start < total:
        raise ValueError(f"window {window_index} is outside a stream of {total} positions (window {window})")
    rng = np.random.default_rng([seed, epoch, slot, window_index, _WINDOW_TAG])
    return start + rng.permutation(min(window, total - start))


def window_permutation(total: int, window: int, seed: int, epoch: int, slot: int) -> np.ndarray:
    """The order in which a slot yields its `total` persons: each window of stream positions shuffled on its own."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    parts = [window_order(total, window, seed, epoch, slot, w) for w in range(-(-total // window))]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def batch_positions(b: int, batch_size: int, total: int) -> range:
    """Indices into the (window-permuted) stream that make batch b."""
    if batch_size < 1 or b < 0:
        raise ValueError(f"need batch_size >= 1 and b >= 0, got batch_size={batch_size}, b={b}")
    return range(min(b * batch_size, total), min((b + 1) * batch_size, total))


def worker_batches_consumed(n: int, num_workers: int, per_worker: list[int], per_message: int = 1) -> list[int]:
    """How many of each worker's batches are among the first n a DataLoader returned (for exact resume).

    A DataLoader (in_order=True, the default) over an IterableDataset returns worker 0's first message, worker 1's
    first, ..., skipping exhausted workers; a message holds ``per_message`` of the worker's batches (its last one
    fewer). After t full rounds worker k has given min(c_k, t * per_message); the n - sum of those leftover batches
    go, in worker order and a message at a time, to the workers that still had more; the last message may be cut.
    """
    if num_workers == 0:
        return [n]
    if len(per_worker) != num_workers:
        raise ValueError(f"per_worker has {len(per_worker)} entries for {num_workers} workers")
    if not 0 <= n <= sum(per_worker):
        raise ValueError(f"{n} batches consumed, but the workers only produce {sum(per_worker)}")
    if per_message < 1:
        raise ValueError(f"per_message must be >= 1, not {per_message}")
    counts = np.asarray(per_worker, dtype=np.int64)
    lo, hi = 0, -(-int(counts.max(initial=0)) // per_message)  # largest t with sum(min(c, t * m)) <= n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid * per_message).sum() <= n:
            lo = mid
        else:
            hi = mid - 1
    taken = np.minimum(counts, lo * per_message)
    extra = n - int(taken.sum())
    for k in np.flatnonzero(counts > taken):
        step = min(per_message, int(counts[k] - taken[k]), extra)
        taken[k] += step
        extra -= step
    return [int(x) for x in taken]


def first_due(consumed: Sequence[int], per_worker: Sequence[int], per_message: int) -> int:
    """The worker whose message an in-order DataLoader returns after ``consumed`` batches: the unfinished one with
    the fewest whole messages returned, the lowest id among equals (round-robin that skips exhausted workers)."""
    due = [(c // per_message, k) for k, (c, total) in enumerate(zip(consumed, per_worker, strict=True)) if c < total]
    return min(due)[1] if due else 0


def pass_roles(skip_total: int, num_workers: int, per_worker: list[int],
               per_message: int = 1) -> list[tuple[int, int]]:
    """(role, batches to skip) of each worker of a pass that resumes after ``skip_total`` batches: worker k reads
    the stream of worker role_k from its batch ``skip`` on. A fresh DataLoader asks worker 0 first, but the batch
    due next may be another worker's, so the roles rotate: the worker asked first plays the one whose batch is due."""
    consumed = worker_batches_consumed(skip_total, num_workers, per_worker, per_message)
    shift = first_due(consumed, per_worker, per_message)
    roles = [(k + shift) % len(per_worker) for k in range(len(per_worker))]
    return [(role, consumed[role]) for role in roles]


def pass_start(epoch: int, resume_skip: int, passes: int) -> tuple[int, int]:
    """(epoch, batches to skip) of a worker's pass after ``passes`` passes since the epoch was set to ``epoch``
    (resuming ``resume_skip`` batches into it): only the first pass resumes; each later one is a whole next epoch."""
    return epoch + passes, resume_skip if passes == 0 else 0


def resume_point(epoch: int, consumed: int, epoch_batches: int) -> tuple[int, int]:
    """(epoch, batches to skip) where the pass after ``consumed`` batches of ``epoch`` resumes: the next epoch's
    start once the epoch's ``epoch_batches`` are all taken."""
    return (epoch + 1, 0) if consumed >= epoch_batches else (epoch, consumed)


@dataclass(frozen=True)
class Window:
    """Window ``index`` of a slot's stream: positions [start, stop), loaded and shuffled together, held by
    ``segments`` in stream order."""

    index: int
    start: int
    stop: int
    segments: tuple[Segment[int], ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def windows(segments: Sequence[Segment[int]], window: int, batch_size: int, drop_last: bool,
            skip: int = 0) -> Iterator[Window]:
    """The windows of a slot's stream (``segments`` in reading order) that hold its batches from batch ``skip`` on;
    a resumed pass starts inside the first one, and one with no batch left loads none."""
    total = slot_persons(segments)
    first = min(skip * batch_size, total)
    last = min(num_batches(total, batch_size, drop_last) * batch_size, total)
    starts = np.cumsum([0] + [s.size for s in segments])
    for w in range(first // window, -(-last // window) if first < last else 0):
        lo, hi = w * window, min((w + 1) * window, total)
        cut = []
        s = int(np.searchsorted(starts, lo, side="right")) - 1  # the segment holding position lo
        while s < len(segments) and starts[s] < hi:
            a, b = max(lo, int(starts[s])), min(hi, int(starts[s + 1]))
            if a < b:
                seg = segments[s]
                cut.append(Segment(seg.shard, seg.start + a - int(starts[s]), seg.start + b - int(starts[s])))
            s += 1
        yield Window(w, lo, hi, tuple(cut))


@dataclass(frozen=True)
class Partition:
    """The plan's inputs for one dataset read by one world of ranks: which persons each slot reads, in which
    order, in how many batches, follows from these alone."""

    sizes: tuple[int, ...]
    world_size: int
    num_workers: int
    mode: str
    seed: int
    shuffle: bool
    batch_size: int
    drop_last: bool
    window: int  # persons loaded and shuffled together

    def segments(self, slot: int, epoch: int) -> list[Segment[int]]:
        return assign(self.sizes, self.world_size, self.num_workers, mode=self.mode, seed=self.seed, epoch=epoch,
                      shuffle=self.shuffle)[slot]

    @functools.cached_property
    def slot_batches(self) -> list[int]:
        """:func:`slot_batches` of this partition, computed once (``len()`` and every pass ask for it)."""
        return slot_batches(self.sizes, self.world_size, self.num_workers, self.batch_size, mode=self.mode,
                            drop_last=self.drop_last)

    def worker_batches(self, rank: int) -> list[int]:
        """Batches each worker of ``rank`` yields per epoch (the same every epoch): its contiguous slots."""
        first = slot_index(rank, 0, self.num_workers)
        return self.slot_batches[first : first + max(1, self.num_workers)]

    def ordered_windows(self, slot: int, epoch: int, skip: int) -> Iterator[tuple[Window, np.ndarray]]:
        """:func:`windows` of the slot's stream this epoch, each with the order its persons are yielded in
        (indices into the window)."""
        segments = self.segments(slot, epoch)
        total = slot_persons(segments)
        for win in windows(segments, self.window, self.batch_size, self.drop_last, skip):
            yield win, (window_order(total, self.window, self.seed, epoch, slot, win.index) - win.start
                        if self.shuffle else np.arange(win.size))


def coverage(plan: list[list[Segment[int]]]) -> tuple[int, int]:
    """(persons read, distinct (shard, person) positions read); the two are equal iff no position is read twice."""
    by_shard: dict[int, list[Segment[int]]] = {}
    for seg in (seg for segments in plan for seg in segments):
        by_shard.setdefault(seg.shard, []).append(seg)
    read = distinct = 0
    for segments in by_shard.values():
        reach = 0
        for seg in sorted(segments, key=lambda s: s.start):
            read += seg.size
            distinct += max(0, seg.stop - max(seg.start, reach))
            reach = max(reach, seg.stop)
    return read, distinct
