"""The rest of an epoch in another arrangement: which persons a resumed run still reads, on which slot, in which order.

A checkpoint records where the epoch stands as ``(epoch, batches)`` plus the arrangement that read it (ranks, workers,
batch size, window, batches per message): every rank had taken the same number of batches, so the arrangement and that
count say exactly which persons of the epoch were trained on (each slot's first ``c * B`` places of its
window-permuted stream, ``c`` from :func:`plan_order.worker_batches_consumed`). Those are never stored, only derived.
How a checkpoint stores the position and the arrangements is :mod:`lifeseq_shards.reader.state`'s.

Resumed in another arrangement, the persons not yet trained form the *rest stream*: each old slot's unconsumed
places, old slot after old slot, in the order the old slot would have yielded them. Its ``N'`` new slots take equal
contiguous parts of it, less the fewer than ``N'`` persons that do not divide (left out of this epoch: the last
ones that the epoch before did not leave out), so every new rank gets the same number of batches; no one is read
twice. A run resumed again in yet another arrangement before the epoch ends repeats this on the rest stream (a history
of legs).

Nobody is left out two epochs running, whatever the arrangements: the next epoch is the new arrangement's ordinary one
but for whom it leaves out. An epoch whose left-out persons are not those its next arrangement would have left out of it
(a rest; an epoch read in another arrangement) hands them on (:func:`next_epoch`, :func:`start_in`) as the next
epoch's ``Position.left_out_before``, and that epoch leaves out others instead (``left_out_segments(keep=...)``),
chosen so that the epoch after it is ordinary again. A run that keeps its arrangement never has any.

Numbering: the resumed epoch keeps the new arrangement's ordinary length ``L'`` (``len()``, Lightning's
``num_training_batches``), and starts at batch ``base = L' - R'`` where ``R'`` are the rest's batches per rank, so it
ends where an ordinary epoch ends. A rest slot's stream is made of *pieces* of old windows: the window's segments
and the indices of the persons to yield (a subset of the window, in order), so the reader loads each old window
once, as the old arrangement would have.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import order as plan_order
from .order import Window, worker_batches_consumed
from .partition import EVEN, Partition, place_runs
from .slots import num_batches, num_slots, slot_index, slot_persons

# the settings a leg may change; the others (dataset, split, seed, mode, shuffle) fix which persons an epoch holds
ARRANGEMENT_KEYS = ("world_size", "num_workers", "batch_size", "drop_last", "window", "batches_per_message",
               "tokens_per_batch")
DEFAULT_WINDOW = 1 << 14  # a token budget's stream places shuffled together: 64 blocks of 256


@dataclass(frozen=True)
class Arrangement:
    """The readers of one leg: ranks, workers, batch size, drop_last, shuffle window, batches per message, and
    the token budget of a rank's batch (0: batches of ``batch_size`` persons; else :mod:`lifeseq_shards.plan.tokens`
    plans the epoch and ``batch_size`` and ``drop_last`` play no part)."""

    world_size: int
    num_workers: int
    batch_size: int
    drop_last: bool
    window: int
    batches_per_message: int
    tokens_per_batch: int = 0

    @classmethod
    def of(cls, values: Sequence[int | bool]) -> Arrangement:
        """The arrangement of ``values`` in :data:`ARRANGEMENT_KEYS` order (a checkpoint's, or the workers' shared
        copy)."""
        return cls(*(bool(v) if k == "drop_last" else int(v) for k, v in zip(ARRANGEMENT_KEYS, values, strict=True)))

    @classmethod
    def of_partition(cls, partition: Partition, batches_per_message: int, tokens_per_batch: int = 0) -> Arrangement:
        """The readers of ``partition`` (whose fields name them), with the loader's batches per message and the
        token budget."""
        return cls(*(getattr(partition, k) for k in ARRANGEMENT_KEYS[:5]), batches_per_message, tokens_per_batch)

    @classmethod
    def of_budget(cls, tokens_per_batch: int, world_size: int, num_workers: int, *, window: int = DEFAULT_WINDOW,
                  batches_per_message: int = 1) -> Arrangement:
        """Readers of batches of ``tokens_per_batch`` real tokens (the token-budget plan's arrangement: batch size
        and drop_last play no part, 1 and False here)."""
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch={tokens_per_batch}: a token budget's arrangement needs >= 1")
        return cls(world_size, num_workers, 1, False, window, batches_per_message, tokens_per_batch)

    @property
    def slots(self) -> int:
        return num_slots(self.world_size, self.num_workers)

    @property
    def workers(self) -> int:
        return max(1, self.num_workers)

    def partition(self, base: Partition) -> Partition:
        """``base``'s persons and order under this arrangement."""
        return dataclasses.replace(base, world_size=self.world_size, num_workers=self.num_workers,
                                   batch_size=self.batch_size, drop_last=self.drop_last, window=self.window)


@dataclass(frozen=True)
class Leg:
    """An arrangement that read part of the epoch and the batches each rank had taken, in that leg's numbering."""

    arrangement: Arrangement
    batches: int


@dataclass(frozen=True)
class Position:
    """Where an epoch stands: ``batches`` of ``epoch`` taken, in this arrangement's numbering, after the ``history`` of
    legs that read its start in other arrangements (none for an ordinary epoch). ``left_out_before``: the persons the
    epoch before left out (:meth:`Partition.person` numbers), when they are not those the arrangement that reads this
    epoch's start leaves out of the epoch before (none in a run that stays in one arrangement): this epoch reads
    them."""

    epoch: int
    batches: int
    history: tuple[Leg, ...] = ()
    left_out_before: tuple[int, ...] = ()

    def resumed(self, epoch_batches: int) -> Position:
        """Where the pass after this position resumes: the next epoch's start once the epoch's ``epoch_batches``
        are all taken (an ordinary one: :func:`next_epoch` says whom it reads)."""
        epoch, batches = plan_order.resume_point(self.epoch, self.batches, epoch_batches)
        if epoch != self.epoch:
            return Position(epoch, batches)
        return Position(epoch, batches, self.history, self.left_out_before)


def epoch_left_out(base: Partition, at: Position, arrangement: Arrangement) -> tuple[int, ...]:
    """The persons ``at``'s epoch leaves out (:meth:`Partition.person` numbers, sorted), read to its end in
    ``arrangement`` after ``at.history``: its first leg's own and, after a resume in another arrangement, those of the
    rest (:attr:`RestPlan.left_out`). drop_last's dropped tails are not counted."""
    if at.history:
        return RestPlan(base, at.epoch, at.history, arrangement, at.left_out_before).left_out_persons()
    return arrangement.partition(base).left_out_persons(at.epoch, at.left_out_before)


def epoch_start(base: Partition, epoch: int, before: Sequence[int], arrangement: Arrangement) -> Position:
    """The start of ``epoch`` read in ``arrangement`` after an epoch that left out ``before``: an ordinary epoch when
    those are the persons ``arrangement`` leaves out of the epoch before, else one that reads them
    (``left_out_before``)."""
    before = tuple(sorted(before))
    if epoch == 0 or before == arrangement.partition(base).left_out_persons(epoch - 1):
        return Position(epoch, 0)
    return Position(epoch, 0, (), before)


def next_epoch(base: Partition, at: Position, arrangement: Arrangement) -> Position:
    """The start of the epoch after ``at``'s, which ``arrangement`` reads to its end (:func:`epoch_left_out`)."""
    return epoch_start(base, at.epoch + 1, epoch_left_out(base, at, arrangement), arrangement)


def start_in(base: Partition, at: Position, then: Arrangement, now: Arrangement) -> Position:
    """``at``, the start of an epoch as ``then`` would read it, read in ``now`` instead: nobody the epoch before
    left out is left out again."""
    before = at.left_out_before or (then.partition(base).left_out_persons(at.epoch - 1) if at.epoch else ())
    return epoch_start(base, at.epoch, before, now)


class _Level:
    """One leg's streams: slot totals, the batches each rank took (from its numbering's base on), and how a range
    of a slot's stream maps onto the streams of the leg before (level 0: the epoch's ordinary partition, less the
    persons it leaves out). A later leg reads the *rest stream*: each slot's unconsumed places, slot after
    slot, then the persons the leg below left out of its own rest; the fewer than its slots that do not divide,
    its *holes*, are left out: the last ones not in ``before`` (the persons the epoch before left out). ``keep``:
    the epoch's ``Position.left_out_before``, which level 0's partition reads."""

    def __init__(self, base: Partition, epoch: int, arrangement: Arrangement, below: _Level | None,
                 keep: tuple[int, ...], before: tuple[int, ...]) -> None:
        self.arrangement, self.below, self.epoch, self.keep, self.before = arrangement, below, epoch, keep, before
        self.partition = arrangement.partition(base)
        self.holes = np.zeros(0, dtype=np.int64)  # places of the rest stream left out, sorted
        self.forced = 0  # of them, persons in ``keep``: a rest too short to leave out others
        if below is None:
            # drop_last's dropped tails are not trained: they stay in the stream (windows then reach the end)
            self.whole = dataclasses.replace(self.partition, drop_last=False)
            self.totals = [slot_persons(self.partition.segments(j, epoch, keep)) for j in range(arrangement.slots)]
            self.base = 0
        else:
            parts = np.append(below.remaining, len(below.holes))
            rest_total = int(parts.sum())
            q = rest_total // arrangement.slots
            self.totals = [q] * arrangement.slots
            self.base = sum(self.partition.worker_batches(0)) - self.rank_batches()
            if self.base < 0:  # R' <= L' holds for every assign that reads at least the epoch's persons again
                raise ValueError(f"the rest of the epoch ({self.rank_batches()} batches per rank) is longer than an "
                                 f"epoch of this arrangement ({self.base + self.rank_batches()})")
            self.starts = np.concatenate([[0], np.cumsum(parts)])
            self.holes = self._holes(rest_total, rest_total - q * arrangement.slots)
        self.consumed: np.ndarray | None = None  # persons of each slot taken, once this leg's batches are known

    def _holes(self, total: int, count: int) -> np.ndarray:
        """The ``count`` places of the rest stream (``total`` long) left out: the last ones whose persons are
        not in ``before`` (the last ones, when nobody is)."""
        tail = np.arange(total - count, total, dtype=np.int64)
        if not self.before or not count:
            return tail
        keep = set(self.before)
        lo = max(0, total - count - len(keep))  # at most len(keep) of the places from here on are kept persons
        persons = self.persons(lo, total)
        free = [lo + i for i, p in enumerate(persons) if p not in keep]
        kept = [lo + i for i, p in enumerate(persons) if p in keep]
        self.forced = max(0, count - len(free))
        chosen = free[len(free) - count:] if not self.forced else free + kept[len(kept) - self.forced:]
        return np.array(sorted(chosen), dtype=np.int64)

    def worker_batches(self, rank: int) -> list[int]:
        if self.below is None:
            return self.partition.worker_batches(rank)
        lay = self.arrangement
        return [num_batches(self.totals[0], lay.batch_size, lay.drop_last)] * lay.workers

    def rank_batches(self) -> int:
        return sum(self.worker_batches(0))

    def take(self, batches: int) -> None:
        """Record that every rank took ``batches`` (this leg's numbering) before the next leg."""
        taken = batches - self.base
        if not 0 <= taken <= self.rank_batches():
            raise ValueError(f"batch {batches} is outside this leg's epoch (batches {self.base}.."
                             f"{self.base + self.rank_batches()})")
        lay = self.arrangement
        per_message = lay.batches_per_message if lay.num_workers else 1
        consumed = np.zeros(lay.slots, dtype=np.int64)
        for rank in range(lay.world_size):
            per_worker = self.worker_batches(rank)
            counts = worker_batches_consumed(taken, lay.num_workers, per_worker, per_message)
            for k, c in enumerate(counts):
                j = slot_index(rank, k, lay.num_workers)
                consumed[j] = min(c * lay.batch_size, self.totals[j])
        self.consumed = consumed

    @property
    def remaining(self) -> np.ndarray:
        assert self.consumed is not None
        return np.asarray(self.totals, dtype=np.int64) - self.consumed

    @property
    def zero(self) -> _Level:
        """Level 0: the epoch's own partition."""
        return self if self.below is None else self.below.zero

    def ranges(self, slot: int, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """Places [start, stop) of ``slot``'s stream as (level-0 slot, start, stop) ranges, in order."""
        if self.below is None:
            yield slot, start, stop
            return
        # the slots take equal contiguous parts of the rest stream less its holes
        lo, hi = slot * self.totals[0] + start, slot * self.totals[0] + stop
        prev = placed = 0  # a run of the stream between holes, and where it starts less the holes
        for hole in [*self.holes.tolist(), int(self.starts[-1])]:
            a, b = max(lo, placed), min(hi, placed + hole - prev)
            if a < b:
                yield from self.rest_ranges(prev + a - placed, prev + b - placed)
            placed, prev = placed + hole - prev, hole + 1
            if placed >= hi:
                return

    def hole_ranges(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """Holes [start, stop) (in order) as level-0 ranges."""
        for lo, hi in place_runs(self.holes[start:stop].tolist()):
            yield from self.rest_ranges(lo, hi)

    def rest_ranges(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """Places [lo, hi) of this leg's rest stream as level-0 ranges, in order."""
        below = self.below
        assert below is not None and below.consumed is not None
        j = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            take = min(hi, int(self.starts[j + 1])) - lo
            if take > 0:
                at = lo - int(self.starts[j])
                if j < below.arrangement.slots:
                    first = int(below.consumed[j]) + at
                    yield from below.ranges(j, first, first + take)
                else:  # the persons the leg below left out: its holes
                    yield from below.hole_ranges(at, at + take)
                lo += take
            j += 1

    def persons(self, lo: int, hi: int) -> list[int]:
        """The persons (:meth:`Partition.person` numbers) at places [lo, hi) of this leg's rest stream."""
        zero = self.zero
        out: list[int] = []
        for j, a, b in self.rest_ranges(lo, hi):
            for _, win, order in zero.pieces(j, a, b):
                flat = [zero.partition.person(seg.shard, i) for seg in win.segments for i in range(seg.start, seg.stop)]
                out += [flat[i] for i in order.tolist()]
        return out

    def pieces(self, j: int, start: int, stop: int) -> Iterator[tuple[tuple[int, int], Window, np.ndarray]]:
        """Level 0: places [start, stop) of slot ``j``'s stream as (key, old window, the indices into it to
        yield), one per window they touch."""
        skip = start // self.arrangement.batch_size
        for win, order in self.whole.ordered_windows(j, self.epoch, skip, self.keep):
            a, b = max(start, win.start), min(stop, win.stop)
            if win.start >= stop:
                return
            if a < b:
                yield (j, win.index), win, order[a - win.start : b - win.start]


class RestPlan:
    """The rest of ``epoch`` for ``arrangement``, after the ``history`` of legs that read its start (oldest first).

    ``base`` is the batch the rest starts at in this arrangement's numbering; ``worker_batches`` the rest's batches per
    worker (equal on every rank); ``trained`` the persons already trained this epoch; ``left_out`` the persons of
    the rest that do not divide among this arrangement's slots (fewer than them; none of ``keep``, the persons the epoch
    before left out, unless the rest holds too few others: ``forced``); ``dropped`` those drop_last drops."""

    def __init__(self, base: Partition, epoch: int, history: Sequence[Leg], arrangement: Arrangement,
                 keep: Sequence[int] = ()) -> None:
        if base.mode != EVEN:
            raise ValueError("only a balanced (training) epoch resumes in another layout")
        if not history:
            raise ValueError("a rest of the epoch needs the legs that read its start")
        level: _Level | None = None
        trained = 0
        kept = tuple(sorted(keep))
        # the rest leaves out none of the persons the epoch before left out: ``keep``, or (an ordinary run until
        # now) those the first leg's arrangement left out of it
        before = kept or (history[0].arrangement.partition(base).left_out_persons(epoch - 1) if epoch else ())
        for leg in history:
            level = _Level(base, epoch, leg.arrangement, level, kept, before)
            level.take(leg.batches)
            assert level.consumed is not None
            trained += int(level.consumed.sum())
        self.level = _Level(base, epoch, arrangement, level, kept, before)
        self.arrangement, self.epoch, self.trained, self.keep = arrangement, epoch, trained, kept
        self.base, self.left_out, self.forced = self.level.base, len(self.level.holes), self.level.forced
        self.slot_persons = self.level.totals[0]

    def left_out_persons(self) -> tuple[int, ...]:
        """The persons this epoch leaves out (:meth:`Partition.person` numbers, sorted): those its first leg's
        partition leaves out, and the rest's :attr:`left_out`."""
        zero = self.level.zero
        rest = [p for lo, hi in place_runs(self.level.holes.tolist()) for p in self.level.persons(lo, hi)]
        return tuple(sorted([*zero.partition.left_out_persons(self.epoch, self.keep), *rest]))

    @functools.cached_property
    def worker_batches(self) -> list[int]:
        return self.level.worker_batches(0)

    @property
    def dropped(self) -> int:
        """Persons of the rest in the slots' last partial batches, which drop_last drops (0 without it)."""
        lay = self.arrangement
        kept = num_batches(self.slot_persons, lay.batch_size, lay.drop_last) * lay.batch_size
        return max(0, self.slot_persons - kept) * lay.slots

    def ordered_pieces(self, slot: int, skip: int) -> Iterator[tuple[Window, np.ndarray]]:
        """The pieces of ``slot``'s rest stream from its batch ``skip`` (counted from the rest's start) on, each a
        :class:`Window` whose ``start``/``stop`` are places in this stream and whose segments are an old
        window's, with the indices into those segments to yield, in order (as ``Partition.ordered_windows``)."""
        lay = self.arrangement
        total = self.slot_persons
        last = min(num_batches(total, lay.batch_size, lay.drop_last) * lay.batch_size, total)
        pos = min(skip * lay.batch_size, last)
        pending: tuple[tuple[int, int], Window, list[np.ndarray]] | None = None
        for j, a, b in self.level.ranges(slot, pos, last):
            for key, win, order in self.level.zero.pieces(j, a, b):
                if pending is not None and pending[0] == key:  # the same old window again, continued: one load
                    pending[2].append(order)
                    continue
                if pending is not None:
                    pos = yield from self._emit(pending, pos)
                pending = key, win, [order]
        if pending is not None:
            yield from self._emit(pending, pos)

    @staticmethod
    def _emit(pending: tuple[tuple[int, int], Window, list[np.ndarray]],
              pos: int) -> Iterator[tuple[Window, np.ndarray]]:
        _, win, parts = pending
        order = np.concatenate(parts)
        yield Window(win.index, pos, pos + len(order), win.segments), order
        return pos + len(order)
