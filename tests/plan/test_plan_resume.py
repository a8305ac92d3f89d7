"""The rest of an epoch in another arrangement (plan_resume): nobody trained is read again, everyone else once, equal
batches on every new rank, fewer than the new readers left out, for any old and new arrangement and any position.

The trained persons are worked out here from the old arrangement's own streams (``Partition.ordered_windows``, the order
each slot yields its persons) and the DataLoader's round-robin (``worker_batches_consumed``); the rest from the
pieces the reader is given, person by person.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lifeseq_shards.plan.order import worker_batches_consumed
from lifeseq_shards.plan.partition import COMPLETE, EVEN, Partition, assign
from lifeseq_shards.plan.resume import Arrangement, Leg, Position, RestPlan, next_epoch, start_in
from lifeseq_shards.plan.slots import Segment, num_batches

Person = tuple[int, int]  # (shard, index in it)


def persons(segments: tuple[Segment[int], ...], order: np.ndarray) -> list[Person]:
    """The persons a window (or piece) yields: its segments' persons, concatenated, taken in ``order``."""
    flat = [(seg.shard, i) for seg in segments for i in range(seg.start, seg.stop)]
    return [flat[i] for i in order.tolist()]


def stream(partition: Partition, slot: int, epoch: int, keep: tuple[int, ...] = ()) -> list[Person]:
    """Every person of ``slot``'s stream in the order it yields them, the dropped tail of drop_last included."""
    whole = dataclasses.replace(partition, drop_last=False)
    return [p for win, order in whole.ordered_windows(slot, epoch, 0, keep) for p in persons(win.segments, order)]


def rest_streams(rest: RestPlan, skip: int = 0) -> list[list[Person]]:
    out = []
    for slot in range(rest.arrangement.slots):
        pos = skip * rest.arrangement.batch_size
        got: list[Person] = []
        for win, order in rest.ordered_pieces(slot, skip):
            assert (win.start, win.stop) == (pos, pos + len(order)), "pieces must tile the stream in order"
            pos = win.stop
            got += persons(win.segments, order)
        out.append(got)
    return out


def taken(streams: list[list[Person]], arrangement: Arrangement, per_worker: list[int], batches: int) -> set[Person]:
    """The persons of the first ``batches`` batches every rank's in-order DataLoader returned."""
    k = arrangement.workers
    per_message = arrangement.batches_per_message if arrangement.num_workers else 1
    counts = worker_batches_consumed(batches, arrangement.num_workers, per_worker, per_message)
    return {p for j, s in enumerate(streams) for p in s[: counts[j % k] * arrangement.batch_size]}


def epoch_persons(partition: Partition, epoch: int) -> set[Person]:
    plan = assign(partition.sizes, partition.world_size, partition.num_workers, mode=EVEN, seed=partition.seed,
                  epoch=epoch, shuffle=partition.shuffle)
    return {(seg.shard, i) for segments in plan for seg in segments for i in range(seg.start, seg.stop)}


arrangements = st.builds(Arrangement, world_size=st.integers(1, 4), num_workers=st.integers(0, 3),
                    batch_size=st.integers(1, 12), drop_last=st.booleans(), window=st.integers(1, 40),
                    batches_per_message=st.integers(1, 4))


@st.composite
def bases(draw: st.DrawFn) -> Partition:
    num_shards, n = draw(st.integers(1, 10)), draw(st.integers(1, 25))
    return Partition((n,) * num_shards, 1, 0, EVEN, draw(st.integers(0, 2**32 - 1)), draw(st.booleans()), 1,
                     False, 1)


def check_rest(rest: RestPlan, epoch_set: set[Person], trained: set[Person], base: Partition) -> list[list[Person]]:
    """The properties every rest of an epoch has; returns its streams."""
    lay = rest.arrangement
    streams = rest_streams(rest)
    read = [p for s in streams for p in s]
    assert len(read) == len(set(read)), "a person read twice in the rest"
    assert not set(read) & trained, "a person trained on before is read again"
    assert set(read) | trained <= epoch_set
    left = epoch_set - trained - set(read)
    assert len(left) == rest.left_out + rest.dropped and rest.left_out < lay.slots
    assert rest.trained == len(trained)
    kept = min(rest.slot_persons, num_batches(rest.slot_persons, lay.batch_size, lay.drop_last) * lay.batch_size)
    assert {len(s) for s in streams} == {kept}, "rest slots of unequal sizes"
    assert rest.dropped == (rest.slot_persons - kept) * lay.slots
    per_rank = [sum(num_batches(len(s), lay.batch_size, lay.drop_last) for s in streams[r * lay.workers:
                                                                                      (r + 1) * lay.workers])
                for r in range(lay.world_size)]
    assert set(per_rank) == {sum(rest.worker_batches)}, "new ranks with unequal batch counts"
    ordinary = lay.partition(base)
    assert rest.base + sum(rest.worker_batches) == sum(ordinary.worker_batches(0)), "the epoch's end moved"
    return streams


@settings(max_examples=300, deadline=None)
@given(bases(), arrangements, arrangements, st.integers(0, 20), st.floats(0, 1), st.integers(0, 10))
def test_rest_of_epoch_reads_everyone_not_yet_trained_once(base, old, new, epoch, at, skip):
    p0 = old.partition(base)
    per_worker = p0.worker_batches(0)
    batches = round(at * sum(per_worker))
    trained = taken([stream(p0, j, epoch) for j in range(old.slots)], old, per_worker, batches)
    rest = RestPlan(base, epoch, (Leg(old, batches),), new)
    streams = check_rest(rest, epoch_persons(p0, epoch), trained, base)
    # resumed again in the same arrangement, ``skip`` batches into the rest: the same streams from there on
    skip = min(skip, max(rest.worker_batches, default=0))
    again = rest_streams(rest, skip)
    assert again == [s[skip * new.batch_size:] for s in streams]


@settings(max_examples=150, deadline=None)
@given(bases(), arrangements, arrangements, arrangements, st.integers(0, 5), st.floats(0, 1), st.floats(0, 1))
def test_a_rest_resumed_in_a_third_arrangement_still_reads_everyone_once(base, first, second, third, epoch, at1, at2):
    p0 = first.partition(base)
    b1 = round(at1 * sum(p0.worker_batches(0)))
    trained = taken([stream(p0, j, epoch) for j in range(first.slots)], first, p0.worker_batches(0), b1)
    rest = RestPlan(base, epoch, (Leg(first, b1),), second)
    taken2 = round(at2 * sum(rest.worker_batches))
    trained |= taken(rest_streams(rest), second, rest.worker_batches, taken2)
    rest3 = RestPlan(base, epoch, (Leg(first, b1), Leg(second, rest.base + taken2)), third)
    check_rest(rest3, epoch_persons(p0, epoch), trained, base)


def test_rest_by_hand() -> None:
    """4 shards of 6, 2 ranks x 1 worker (unshuffled), batch 2: slot 0 reads shards 0 and 2, slot 1 shards 1 and 3.
    After 2 batches each slot trained its first 4; the 16 others, over 3 ranks, are 5 each and 1 left out."""
    base = Partition((6,) * 4, 1, 0, EVEN, 0, False, 1, False, 1)
    old, new = Arrangement(2, 0, 2, False, 100, 1), Arrangement(3, 0, 2, False, 100, 1)
    rest = RestPlan(base, 0, (Leg(old, 2),), new)
    streams = rest_streams(rest)
    assert streams == [[(0, 4), (0, 5), (2, 0), (2, 1), (2, 2)],
                       [(2, 3), (2, 4), (2, 5), (1, 4), (1, 5)],
                       [(3, 0), (3, 1), (3, 2), (3, 3), (3, 4)]]
    assert (rest.trained, rest.left_out, rest.worker_batches, rest.base) == (8, 1, [3], 1)


def test_what_cannot_continue_is_refused() -> None:
    base = Partition((6,) * 4, 1, 0, EVEN, 0, False, 1, False, 1)
    lay = Arrangement(2, 0, 2, False, 100, 1)
    with pytest.raises(ValueError, match="only a balanced"):
        RestPlan(dataclasses.replace(base, mode=COMPLETE), 0, (Leg(lay, 1),), lay)
    with pytest.raises(ValueError, match="outside this leg's epoch"):
        RestPlan(base, 0, (Leg(lay, 7),), lay)


# -- nobody left out two epochs running, across any sequence of arrangements
# ----------------------------------------------
def everyone(base: Partition) -> set[Person]:
    """The split's persons: its shards, then the remainder shard (number len(sizes))."""
    shards = {(s, i) for s, n in enumerate(base.sizes) for i in range(n)}
    return shards | {(len(base.sizes), i) for i in range(base.remainder)}


def read_epoch(base: Partition, start: Position,
               legs: list[tuple[Arrangement, float]]) -> tuple[set[Person], Position, int]:
    """The persons an epoch reads from ``start`` through ``legs`` (each arrangement takes a fraction of what is left
    to it, the last reads to the end), as a loader resumed in each arrangement would; where it ends; and how many
    persons the epoch before left out its rests had to leave out too (a rest shorter than them)."""
    at, read, forced = start, set(), 0
    for i, (arrangement, fraction) in enumerate(legs):
        if at.history:
            rest = RestPlan(base, at.epoch, at.history, arrangement, at.left_out_before)
            forced += rest.forced
            streams, per_worker, first = rest_streams(rest), rest.worker_batches, rest.base
        else:
            part = arrangement.partition(base)
            streams = [stream(part, j, at.epoch, at.left_out_before) for j in range(arrangement.slots)]
            per_worker, first = part.worker_batches(0), 0
        last = i == len(legs) - 1
        batches = sum(per_worker) if last else round(fraction * sum(per_worker))
        read |= taken(streams, arrangement, per_worker, batches)
        if not last and (batches or at.history):  # the next arrangement resumes from a checkpoint here: the rest
            at = Position(at.epoch, first + batches, (*at.history, Leg(arrangement, first + batches)),
                          at.left_out_before)
        elif not last:  # nothing of the epoch trained yet: the next arrangement's own epoch
            at = start_in(base, at, arrangement, legs[i + 1][0])
    return read, at, forced


long_bases = st.builds(lambda num_shards, n, remainder, seed, shuffle: Partition(
    (n,) * num_shards, 1, 0, EVEN, seed, shuffle, 1, False, 1, remainder % n),
    st.integers(3, 8), st.integers(12, 30), st.integers(0, 29), st.integers(0, 2**32 - 1), st.booleans())
exact_arrangements = st.builds(Arrangement, world_size=st.integers(1, 4), num_workers=st.integers(0, 3),
                          batch_size=st.integers(1, 12), drop_last=st.just(False), window=st.integers(1, 40),
                          batches_per_message=st.integers(1, 4))
epochs = st.lists(st.lists(st.tuples(exact_arrangements, st.floats(0, 0.9)), min_size=1, max_size=3), min_size=2,
                  max_size=4)


@settings(max_examples=200, deadline=None)
@given(long_bases, epochs, st.integers(0, 6))
def test_nobody_is_left_out_two_epochs_running_across_arrangements(base, plan, first_epoch):
    """Any sequence of arrangements, each resumed at any position of its epoch (or at an epoch's start): the persons
    one epoch leaves out are all read in the next (the remainder rotated in), as in a run that keeps its arrangement."""
    split = everyone(base)
    at = Position(first_epoch, 0)
    before: set[Person] | None = None
    for i, legs in enumerate(plan):
        if i:  # the previous epoch's last arrangement saved the start of this one; this epoch's first resumes it
            at = start_in(base, at, plan[i - 1][-1][0], legs[0][0]) if legs[0][0] != plan[i - 1][-1][0] else at
        read, end, forced = read_epoch(base, at, legs)
        assume(not forced)  # a rest begun at the epoch's very end, shorter than the persons to keep in
        left = split - read
        assert len(left) < sum(arr.slots for arr, _ in legs) + 1, "more left out than the arrangements leave"
        if before is not None:
            assert not left & before, f"left out two epochs running: {sorted(left & before)}"
        before = left
        at = next_epoch(base, end, legs[-1][0])


@settings(max_examples=200, deadline=None)
@given(bases(), arrangements, st.integers(0, 20), st.floats(0, 1))
def test_a_run_in_one_arrangement_keeps_its_ordinary_epochs(base, arrangement, epoch, at):
    """The persons the epoch before left out are those the arrangement leaves out: the next epoch is its ordinary
    one."""
    batches = round(at * sum(arrangement.partition(base).worker_batches(0)))
    assert next_epoch(base, Position(epoch, batches), arrangement) == Position(epoch + 1, 0)


def test_a_rest_in_another_arrangement_then_its_next_epoch_by_hand() -> None:
    """6 shards of 20 and 7 remainder persons (127), 2 ranks x 2 workers stopped after 5 batches of 4, resumed on
    3 x 2: the persons left out of the epoch (the first arrangement's 3, the rest's) are all read in the next epoch."""
    base = Partition((20,) * 6, 1, 0, EVEN, 3, True, 1, False, 1, 7)
    old, new = Arrangement(2, 2, 4, False, 16, 1), Arrangement(3, 2, 4, False, 16, 1)
    read, end, forced = read_epoch(base, Position(0, 0), [(old, 5 / 16), (new, 0.0)])
    assert end == Position(0, 5, (Leg(old, 5),)) and not forced
    nxt = next_epoch(base, end, new)
    again, _, _ = read_epoch(base, nxt, [(new, 0.0)])
    split = everyone(base)
    assert split - read and not (split - read) & (split - again)
