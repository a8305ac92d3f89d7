"""Partition math for DDP reading: which persons each (rank, worker) slot reads, in which order, and how many batches.

Under DDP with R ranks and K DataLoader workers per rank, N = R * max(K, 1) *slots* read disjoint parts of a split
without talking to each other. Two invariants make this safe:

* every rank yields the same number of batches, otherwise the gradient all-reduce of the longer ranks hangs;
* every person is read at most once per epoch (exactly once in complete mode, for inference, where nothing may be
  dropped).

In balanced mode (training) the shards all hold the same number n of persons, so whole shards dealt round-robin
give every slot the same budget; the S % N shards that do not go round evenly are pooled and cut into N equal
slices. What is left of the pool and the remainder shard (the persons that did not fill the last round of shards
at conversion) are shared out equally too, as each slot's last persons; the (S * n + r) % N < N persons that still
do not divide are left out for this epoch only: a run of consecutive persons of the split (remainder first, then
the shards in manifest order) that moves on by its own length every epoch, so two epochs in a row never leave out
the same person and every person is read in one of any two consecutive epochs (``left_out_segments``).

In exact mode (validation) every person of the split, remainder included, is read once, and every rank yields the
same number of batches: the shards are read as one stream cut into per-slot runs whose batch counts add up to the
same number on every rank (:mod:`lifeseq_shards.plan.exact`); an arrangement where that cannot be had is refused, saying
what to change.

The units (``Segment``, slots, batch counts) are :mod:`lifeseq_shards.plan.slots`'; the order within a slot's stream,
its windows and where a resumed pass starts, :mod:`lifeseq_shards.plan.order`'s. Everything in these modules is a pure
function of its arguments (no I/O, no global RNG), so all slots compute the same plan independently and a resumed run
recomputes it exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .exact import exact_slot_persons
from .order import Window, _shuffled, windows
from .slots import Segment, _cut, num_batches, num_slots, slot_index, slot_persons

# even (the value "balanced", which saved states and the CLI keep): every rank the same number of batches
# (training); fewer than N persons that do not divide are left out, others each epoch. complete: every person exactly
# once (inference); ranks may yield different counts. exact: every person exactly once and every rank the same number of
# batches (validation), or refused.
EVEN, COMPLETE, EXACT = "balanced", "complete", "exact"
MODES = (EVEN, COMPLETE, EXACT)
_RENAMED = {"train": EVEN, "inference": COMPLETE}  # old names: refused, naming the new one
# the names a checkpoint's loader arrangement records: the old ones, so that states saved before the rename resume
STORED_MODE = {**{mode: old for old, mode in _RENAMED.items()}, EXACT: EXACT}
# Mixed into the shard order's RNG seeds, unlike plan_order's _WINDOW_TAG, so the shard order and the window
# shuffles never share a stream.
_ORDER_TAG = 0x4F524452  # "ORDR"


def mode_name(mode: str) -> str:
    """``mode``, checked: ValueError for anything but the three modes, naming the new name of a renamed one."""
    if mode in _RENAMED:
        raise ValueError(f"mode={mode!r} is renamed: use mode={_RENAMED[mode]!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be {EVEN!r}, {COMPLETE!r} or {EXACT!r}, not {mode!r}")
    return mode


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
    """Pool places [start, stop) as segments; the pool is the concatenation of shards `pool`, n persons each."""
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
    remainder: int = 0,
    batch_size: int | None = None,
) -> list[list[Segment[int]]]:
    """The segments each slot reads, in reading order; list index = slot_index(rank, worker, num_workers).

    balanced: equal shards and a ``remainder`` shard of any size (shard number ``len(shard_sizes)``); whole shards
    round-robin, then an equal slice of the pooled tail shards per slot, then an equal share of what is left of the
    pool and the remainder (:func:`slot_streams` says where that share starts).
    complete: any sizes (the remainder shard last); slot j reads whole shards j, j+N, ... - nothing is dropped,
    slot counts may differ.
    exact: any sizes (the remainder shard last), read as one stream cut into :func:`exact_slot_persons` runs (needs
    ``batch_size``): every person once, the same batches on every rank.
    """
    return [segments for segments, _ in slot_streams(shard_sizes, world_size, num_workers, mode=mode, seed=seed,
                                                     epoch=epoch, shuffle=shuffle, remainder=remainder,
                                                     batch_size=batch_size)]


def slot_streams(
    shard_sizes: Sequence[int],
    world_size: int,
    num_workers: int,
    *,
    mode: str,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    remainder: int = 0,
    batch_size: int | None = None,
    keep: Sequence[int] = (),
) -> list[tuple[list[Segment[int]], int]]:
    """:func:`assign`'s segments of each slot with the stream place where its share of the pooled persons
    starts (balanced; the stream's length otherwise): shuffle windows end there, so that the share, a few persons
    that vary with the epoch, does not reorder the persons before it. ``keep``: balanced mode's persons not to leave
    out (:func:`left_out_segments`)."""
    slots = num_slots(world_size, num_workers)
    mode = mode_name(mode)
    if remainder < 0:
        raise ValueError(f"remainder must be >= 0, got {remainder}")
    if mode == EVEN:
        return _even_streams(shard_sizes, slots, seed, epoch, shuffle, remainder, keep)
    if any(size < 0 for size in shard_sizes):
        raise ValueError(f"shard sizes must be >= 0, got {list(shard_sizes)}")
    if remainder:
        raise ValueError(f"mode {mode!r} takes the remainder shard as the last of shard_sizes, not as remainder=")
    if mode == COMPLETE:
        plan = [[Segment(s, 0, int(shard_sizes[s])) for s in range(j, len(shard_sizes), slots)] for j in range(slots)]
        return [(segments, slot_persons(segments)) for segments in plan]
    if batch_size is None:
        raise ValueError("exact mode needs the batch size: its per-slot runs make equal batch counts per rank")
    counts = exact_slot_persons(sum(shard_sizes), world_size, num_workers, batch_size)
    order = epoch_shard_order(len(shard_sizes), seed, epoch) if shuffle else np.arange(len(shard_sizes))
    stream = [Segment(int(s), 0, int(shard_sizes[s])) for s in order if shard_sizes[s]]
    bounds = np.cumsum([0, *counts]).tolist()
    return [(_cut(stream, lo, hi), hi - lo) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _even_streams(shard_sizes: Sequence[int], slots: int, seed: int, epoch: int, shuffle: bool,
                      remainder: int, keep: Sequence[int] = ()) -> list[tuple[list[Segment[int]], int]]:
    n = _train_size(shard_sizes)
    num_shards = len(shard_sizes)
    order = epoch_shard_order(num_shards, seed, epoch) if shuffle else np.arange(num_shards)
    whole = num_shards // slots * slots
    pool = order[whole:]
    pooled = len(pool) * n
    q = pooled // slots
    # what no slice of the pool took, then the remainder shard: shared out equally after each slot's own persons
    rest = _pool_slice(pool, n, slots * q, pooled) + ([Segment(num_shards, 0, remainder)] if remainder else [])
    share = slot_persons(rest) // slots
    holes = left_out_segments(shard_sizes, slots, 0, epoch=epoch, remainder=remainder, keep=keep)
    rest = _without(rest, holes)
    out, taken = [], 0
    for j in range(slots):
        own = [Segment(int(s), 0, n) for s in order[j:whole:slots]] + _pool_slice(pool, n, j * q, (j + 1) * q)
        kept = _without(own, holes)
        take = share + slot_persons(own) - slot_persons(kept)  # a slot that lost persons to the holes gets more
        out.append((kept + _cut(rest, taken, taken + take), slot_persons(kept)))
        taken += take
    return out


def left_out_segments(shard_sizes: Sequence[int], world_size: int, num_workers: int, *, epoch: int,
                      remainder: int = 0, keep: Sequence[int] = ()) -> list[Segment[int]]:
    """The persons balanced mode leaves out of ``epoch`` (all of them when there are fewer persons than slots):
    ``left_out`` consecutive persons of the split counted remainder first (shard number ``len(shard_sizes)``),
    then the shards in manifest order, starting ``epoch * left_out`` persons in (cyclically).

    ``keep``: persons (counted so) that the epoch before left out in another arrangement (:mod:`.resume`), none of whom
    may be left out again. When the run holds one, the ``left_out`` persons nearest before the next epoch's run
    that are not in ``keep`` are left out instead, so that the next epoch's own run still leaves out others."""
    slots = num_slots(world_size, num_workers)
    n = _train_size(shard_sizes)
    total = len(shard_sizes) * n + remainder
    lost = total % slots
    if lost == 0:
        return []
    start = epoch * lost % total
    runs = [(start, min(start + lost, total)), (0, max(start + lost - total, 0))]
    kept = set(keep)
    if kept and any(lo <= p < hi for p in kept for lo, hi in runs):
        runs = place_runs(_before(total, lost, (epoch + 1) * lost % total, kept))
    out = []
    for lo, hi in runs:
        out += counted_segments(len(shard_sizes), n, remainder, lo, hi)
    return out


def counted_segments(num_shards: int, n: int, remainder: int, lo: int, hi: int) -> list[Segment[int]]:
    """Persons [lo, hi) of a balanced split counted remainder first (shard number ``num_shards``), then the
    shards of ``n`` persons in manifest order, as segments."""
    out = []
    if lo < min(hi, remainder):
        out.append(Segment(num_shards, lo, min(hi, remainder)))
    lo, hi = max(lo, remainder) - remainder, max(hi, remainder) - remainder
    return out + _pool_slice(range(num_shards), n, lo, hi)


def _before(total: int, count: int, end: int, skip: set[int]) -> list[int]:
    """The ``count`` persons nearest before ``end`` (cyclically, of ``total``) that are not in ``skip``, sorted
    (fewer when there are not that many)."""
    out: list[int] = []
    for i in range(1, total + 1):
        if len(out) == count:
            break
        if (p := (end - i) % total) not in skip:
            out.append(p)
    return sorted(out)


def place_runs(places: list[int]) -> list[tuple[int, int]]:
    """Sorted places as [lo, hi) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in places:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def _without(segments: Sequence[Segment[int]], holes: Sequence[Segment[int]]) -> list[Segment[int]]:
    """``segments`` in order, less the persons of ``holes``."""
    out = []
    for seg in segments:
        pieces = [seg]
        for hole in holes:
            if hole.shard != seg.shard:
                continue
            pieces = [part for p in pieces for part in (Segment(p.shard, p.start, min(p.stop, hole.start)),
                                                          Segment(p.shard, max(p.start, hole.stop), p.stop))
                      if part.size > 0]
        out += pieces
    return out


def left_out(shard_sizes: Sequence[int], world_size: int, num_workers: int, mode: str, remainder: int = 0) -> int:
    """Persons no slot reads this epoch: (S * n + remainder) % N when balanced (always < N), 0 otherwise."""
    slots = num_slots(world_size, num_workers)
    if mode_name(mode) != EVEN:
        return 0
    n = _train_size(shard_sizes)
    return (len(shard_sizes) * n + remainder) % slots


def slot_batches(shard_sizes: Sequence[int], world_size: int, num_workers: int, batch_size: int, *, mode: str,
                 drop_last: bool = False, remainder: int = 0) -> list[int]:
    """Batches per slot, every epoch: slot budgets do not depend on the shard order, hence not on seed/epoch."""
    if drop_last and mode_name(mode) == EXACT:
        raise ValueError("exact mode reads every person: drop_last would drop each slot's last partial batch")
    plan = assign(shard_sizes, world_size, num_workers, mode=mode, shuffle=False, remainder=remainder,
                  batch_size=batch_size)
    return [num_batches(slot_persons(segments), batch_size, drop_last) for segments in plan]


def rank_batches(shard_sizes: Sequence[int], world_size: int, num_workers: int, batch_size: int, *, mode: str,
                 drop_last: bool = False, remainder: int = 0) -> list[int]:
    """Batches per rank (sum over its slots)."""
    return sum_per_rank(slot_batches(shard_sizes, world_size, num_workers, batch_size, mode=mode,
                                     drop_last=drop_last, remainder=remainder), num_workers)


def sum_per_rank(per_slot: list[int], num_workers: int) -> list[int]:
    """Sum per-slot values over each rank's contiguous block of slots."""
    k = max(num_workers, 1)
    return [sum(per_slot[start : start + k]) for start in range(0, len(per_slot), k)]


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
    remainder: int = 0  # balanced mode: the remainder shard's persons (shard number len(sizes)), shared out

    def stream(self, slot: int, epoch: int, keep: Sequence[int] = ()) -> tuple[list[Segment[int]], int]:
        """The slot's segments this epoch and where its share of the pooled persons starts (:func:`slot_streams`;
        ``keep``: the persons not to leave out, :func:`left_out_segments`)."""
        return slot_streams(self.sizes, self.world_size, self.num_workers, mode=self.mode, seed=self.seed,
                            epoch=epoch, shuffle=self.shuffle, remainder=self.remainder,
                            batch_size=self.batch_size, keep=keep)[slot]

    def segments(self, slot: int, epoch: int, keep: Sequence[int] = ()) -> list[Segment[int]]:
        return self.stream(slot, epoch, keep)[0]

    def person(self, shard: int, index: int) -> int:
        """Person ``index`` of ``shard`` as :func:`left_out_segments` counts persons (the remainder shard first)."""
        return index if shard == len(self.sizes) else self.remainder + shard * self.sizes[0] + index

    def left_out_persons(self, epoch: int, keep: Sequence[int] = ()) -> tuple[int, ...]:
        """The persons balanced mode leaves out of ``epoch`` (:func:`left_out_segments`), as :meth:`person`."""
        holes = left_out_segments(self.sizes, self.world_size, self.num_workers, epoch=epoch,
                                  remainder=self.remainder, keep=keep)
        return tuple(sorted(self.person(seg.shard, i) for seg in holes for i in range(seg.start, seg.stop)))

    @functools.cached_property
    def slot_batches(self) -> list[int]:
        """:func:`slot_batches` of this partition, computed once (``len()`` and every pass ask for it)."""
        return slot_batches(self.sizes, self.world_size, self.num_workers, self.batch_size, mode=self.mode,
                            drop_last=self.drop_last, remainder=self.remainder)

    def worker_batches(self, rank: int) -> list[int]:
        """Batches each worker of ``rank`` yields per epoch (the same every epoch): its contiguous slots."""
        first = slot_index(rank, 0, self.num_workers)
        return self.slot_batches[first : first + max(1, self.num_workers)]

    def ordered_windows(self, slot: int, epoch: int, skip: int,
                        keep: Sequence[int] = ()) -> Iterator[tuple[Window, np.ndarray]]:
        """:func:`windows` of the slot's stream this epoch (``keep``: the persons not to leave out), each with the
        order its persons are yielded in (indices into the window)."""
        segments, cut = self.stream(slot, epoch, keep)
        for win in windows(segments, self.window, self.batch_size, self.drop_last, skip, cut):
            yield win, (_shuffled(win.size, self.seed, epoch, slot, win.index) if self.shuffle
                        else np.arange(win.size))


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
