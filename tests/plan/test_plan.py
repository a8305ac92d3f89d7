"""The partition invariants DDP relies on: disjoint coverage, equal batches per rank, reproducible orders."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import shardify
from hypothesis import given
from hypothesis import strategies as st
from small_inputs import assert_refused

from lifeseq_shards.plan import partition as plan_module
from lifeseq_shards.plan.asked import Topology
from lifeseq_shards.plan.exact import exact_slot_persons
from lifeseq_shards.plan.order import (
    batch_places,
    first_due,
    pass_roles,
    pass_start,
    resume_point,
    window_order,
    window_permutation,
    windows,
    worker_batches_consumed,
)
from lifeseq_shards.plan.partition import (
    COMPLETE,
    EVEN,
    EXACT,
    Partition,
    assign,
    coverage,
    epoch_shard_order,
    left_out,
    left_out_segments,
    mode_name,
    rank_batches,
    sum_per_rank,
)
from lifeseq_shards.plan.report import describe
from lifeseq_shards.plan.slots import Segment, num_batches, num_slots, slot_index, slot_persons
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World

worlds = st.integers(1, 8)
workers = st.integers(0, 8)
seeds = st.integers(0, 2**32 - 1)
epochs = st.integers(0, 1000)
batches = st.integers(1, 64)


def read_counts(plan: list[list[Segment]], shard_sizes: list[int]) -> list[np.ndarray]:
    """How often each (shard, person) position is read, counted position by position."""
    counts = [np.zeros(size, dtype=np.int64) for size in shard_sizes]
    for segments in plan:
        for seg in segments:
            assert 0 <= seg.start <= seg.stop <= shard_sizes[seg.shard]
            counts[seg.shard][seg.start : seg.stop] += 1
    return counts


@given(worlds, workers, st.integers(1, 60), st.integers(1, 50), st.data(), batches, seeds, epochs, st.booleans(),
       st.booleans())
def test_train_plan_is_disjoint_and_balanced(world, k, num_shards, n, data, batch, seed, epoch, shuffle, drop_last):
    rem = data.draw(st.integers(0, num_shards - 1) | st.integers(0, 3 * num_shards))  # < S at conversion, or edited
    sizes = [n] * num_shards
    total = num_shards * n + rem
    slots = world * max(k, 1)
    plan = assign(sizes, world, k, mode=EVEN, seed=seed, epoch=epoch, shuffle=shuffle, remainder=rem)
    assert len(plan) == slots
    counts = read_counts(plan, [*sizes, rem])
    dropped = left_out(sizes, world, k, EVEN, remainder=rem)
    assert max(c.max(initial=0) for c in counts) <= 1
    assert sum(int(c.sum()) for c in counts) == total - dropped
    assert dropped == total % slots < slots  # the remainder is read too: at most N - 1 left out
    assert coverage(plan) == (total - dropped, total - dropped)
    # exactly the persons left_out_segments names are not read
    unread = read_counts([left_out_segments(sizes, world, k, epoch=epoch, remainder=rem)], [*sizes, rem])
    assert all(np.array_equal(c + u, np.ones_like(c)) for c, u in zip(counts, unread, strict=True))
    # Whole shards dealt round-robin are read in one piece by one slot, but for the persons left out.
    order = epoch_shard_order(num_shards, seed, epoch) if shuffle else np.arange(num_shards)
    for s in order[: num_shards - num_shards % slots]:
        readers = [j for j, segments in enumerate(plan) if any(seg.shard == s for seg in segments)]
        assert len(readers) <= 1 and counts[s].sum() + unread[s].sum() == n
    budgets = {slot_persons(segments) for segments in plan}
    assert budgets == {(total - dropped) // slots}
    per_rank = rank_batches(sizes, world, k, batch, mode=EVEN, drop_last=drop_last, remainder=rem)
    assert len(per_rank) == world and len(set(per_rank)) == 1
    assert per_rank[0] == max(k, 1) * num_batches(budgets.pop(), batch, drop_last)


@given(worlds, workers, st.integers(1, 30), st.integers(1, 20), st.integers(0, 60), seeds, epochs, st.booleans())
def test_no_person_is_left_out_two_epochs_running(world, k, num_shards, n, rem, seed, epoch, shuffle):
    """The persons left out move on every epoch: none twice in a row, so everyone is read in one of any two
    consecutive epochs (when there are at least as many persons as slots; else nobody can be read)."""
    sizes, shape = [n] * num_shards, [*([n] * num_shards), rem]
    total, slots = num_shards * n + rem, world * max(k, 1)
    read = [read_counts(assign(sizes, world, k, mode=EVEN, seed=seed, epoch=e, shuffle=shuffle, remainder=rem),
                        shape) for e in (epoch, epoch + 1)]
    either = [a + b for a, b in zip(*read, strict=True)]
    if total >= slots:
        assert all((c >= 1).all() for c in either)
    else:
        assert all((c == 0).all() for c in either)


@given(worlds, workers, st.lists(st.integers(0, 50), min_size=0, max_size=60), batches)
def test_inference_reads_every_person_exactly_once(world, k, sizes, batch):
    plan = assign(sizes, world, k, mode=COMPLETE, seed=7, epoch=3)
    assert all((c == 1).all() for c in read_counts(plan, sizes))
    assert left_out(sizes, world, k, COMPLETE) == 0
    slots = num_slots(world, k)
    for j, segments in enumerate(plan):
        assert [seg.shard for seg in segments] == list(range(j, len(sizes), slots))
    assert sum(rank_batches(sizes, world, k, batch, mode=COMPLETE)) == sum(
        num_batches(slot_persons(segments), batch) for segments in plan
    )


def equal_batches_possible(total: int, world: int, k: int, batch: int) -> bool:
    """By enumeration: can ``total`` persons be cut into world x k slot runs (any sizes) so that every rank's
    batches (each slot batches its own run) come to the same number?"""
    one = {(p, -(-p // batch)) for p in range(total + 1)}
    rank = {(0, 0)}
    for _ in range(k):  # (persons, batches) a rank's k slots can hold
        rank = {(p + q, b + c) for p, b in rank for q, c in one if p + q <= total}
    for b in {b for _, b in rank}:
        sums = {0}
        for _ in range(world):
            sums = {x + p for x in sums for p, c in rank if c == b and x + p <= total}
        if total in sums:
            return True
    return False


@given(st.integers(1, 4), st.integers(0, 3), st.lists(st.integers(0, 12), min_size=1, max_size=6),
       st.integers(1, 9), seeds, epochs, st.booleans())
def test_exact_plan_reads_everyone_once_in_equal_rank_batches(world, k, sizes, batch, seed, epoch, shuffle):
    total = sum(sizes)
    possible = equal_batches_possible(total, world, max(k, 1), batch)
    if not possible:
        with pytest.raises(ValueError, match=r"cannot each be read once .* use "):
            assign(sizes, world, k, mode=EXACT, batch_size=batch, seed=seed, epoch=epoch, shuffle=shuffle)
        return
    plan = assign(sizes, world, k, mode=EXACT, batch_size=batch, seed=seed, epoch=epoch, shuffle=shuffle)
    assert all((c == 1).all() for c in read_counts(plan, sizes))  # every person, remainder included, once
    assert left_out(sizes, world, k, EXACT) == 0
    per_rank = rank_batches(sizes, world, k, batch, mode=EXACT)
    assert len(set(per_rank)) == 1
    per_slot = [num_batches(slot_persons(segments), batch) for segments in plan]
    assert sum_per_rank(per_slot, k) == per_rank  # the same every epoch, whatever the shard order
    assert [slot_persons(segments) for segments in plan] == exact_slot_persons(total, world, k, batch)


@pytest.mark.parametrize(("total", "world", "k", "batch", "said"), [
    (1, 2, 0, 32, "use at most 1 ranks, or a split of at least 2 persons"),
    (2051, 8, 0, 256, "use batch size 255 or 257, or more workers per rank"),
])
def test_exact_plan_refuses_saying_what_to_change(total, world, k, batch, said):
    with pytest.raises(ValueError, match=said):
        exact_slot_persons(total, world, k, batch)
    assert exact_slot_persons(2051, 8, 2, 256)  # two workers a rank: a rank of 256 persons makes 2 batches too


def test_issue_val_layouts_by_hand():
    """The layouts of the issue: --shards 120 --num-val 200 (120 shards of 1 + 80), --shards 7 --num-val 10,
    --shards 4 --val-fraction 0.001 (4 shards of 1 + 3): every person once."""
    for sizes, world, k in (([1] * 120 + [80], 2, 2), ([1] * 7 + [3], 1, 0), ([1] * 4 + [3], 2, 2)):
        plan = assign(sizes, world, k, mode=EXACT, batch_size=32, shuffle=False)
        assert all((c == 1).all() for c in read_counts(plan, sizes))
    assert exact_slot_persons(200, 2, 2, 32) == [50, 50, 50, 50]  # 2 batches a slot, 4 a rank
    assert exact_slot_persons(7, 2, 2, 32) == [4, 0, 3, 0]  # 1 batch a rank, from its first worker
    assert rank_batches([1] * 4 + [3], 2, 2, 32, mode=EXACT) == [1, 1]


@given(st.integers(0, 60), seeds, epochs)
def test_epoch_order_is_a_reproducible_permutation(num_shards, seed, epoch):
    order = epoch_shard_order(num_shards, seed, epoch)
    assert sorted(order.tolist()) == list(range(num_shards))
    assert np.array_equal(order, epoch_shard_order(num_shards, seed, epoch))
    if num_shards >= 4:
        others = [epoch_shard_order(num_shards, seed, e) for e in range(epoch + 1, epoch + 10)]
        assert any(not np.array_equal(order, o) for o in others)


@given(st.integers(0, 500), st.integers(1, 64), seeds, epochs, st.integers(0, 64), st.integers(0, 100))
def test_window_permutation_stays_in_its_windows(total, window, seed, epoch, slot, extra):
    perm = window_permutation(total, window, seed, epoch, slot)
    assert sorted(perm.tolist()) == list(range(total))
    for start in range(0, total, window):
        chunk = perm[start : start + window]
        assert sorted(chunk.tolist()) == list(range(start, min(start + window, total)))
        assert np.array_equal(chunk, window_order(total, window, seed, epoch, slot, start // window))
    # Full windows do not depend on how long the stream is: a resumed reader recomputes only its own window.
    full = total // window * window
    assert np.array_equal(window_permutation(total + extra, window, seed, epoch, slot)[:full], perm[:full])
    assert np.array_equal(perm, window_permutation(total, window, seed, epoch, slot))


@given(st.integers(0, 500), batches)
def test_batch_positions_tile_the_stream(total, batch):
    ranges = [batch_places(b, batch, total) for b in range(num_batches(total, batch))]
    assert [p for r in ranges for p in r] == list(range(total))
    assert all(len(r) == batch for r in ranges[:-1])
    assert len(batch_places(num_batches(total, batch), batch, total)) == 0


def round_robin(per_worker: list[int], per_message: int = 1) -> list[int]:
    """The worker id of each batch a DataLoader returns: cycle over workers, skipping exhausted ones, a message of
    up to ``per_message`` batches from each in turn."""
    left = list(per_worker)
    out = []
    while any(left):
        for w, c in enumerate(left):
            step = min(c, per_message)
            out += [w] * step
            left[w] -= step
    return out


@given(st.lists(st.integers(0, 12), min_size=1, max_size=8), st.integers(1, 5), st.data())
def test_worker_batches_consumed_matches_round_robin(per_worker, per_message, data):
    sequence = round_robin(per_worker, per_message)
    n = data.draw(st.integers(0, len(sequence)))
    expected = [sequence[:n].count(w) for w in range(len(per_worker))]
    assert worker_batches_consumed(n, len(per_worker), per_worker, per_message) == expected


# Hand-computed cases: (sizes, world, workers) -> per-slot segments as (shard, start, stop), with shuffle off, epoch 0:
# the persons left out are the first (S * n) % N of shard 0 (no remainder here); a slot that loses some to them
# takes as many more of what the pool slices left.
HAND_CASES = [
    # N=2: shards 0..3 round-robin, shard 4 (10 persons) split 5/5.
    ([10] * 5, 2, 0, [[(0, 0, 10), (2, 0, 10), (4, 0, 5)], [(1, 0, 10), (3, 0, 10), (4, 5, 10)]], 0),
    # N=3: one whole shard each, pool = shard 3 (5 persons), q=1; 2 left out: shard 0's first two, so slot 0 takes
    # the two persons of shard 3 no slice took.
    ([5] * 4, 3, 0, [[(0, 2, 5), (3, 0, 1), (3, 3, 5)], [(1, 0, 5), (3, 1, 2)], [(2, 0, 5), (3, 2, 3)]], 2),
    # N=3 from 1 rank x 3 workers: pool = shards 3,4 (10 persons), q=3, the middle slice crosses shards; 1 left out
    # (shard 0's first), so slot 0 takes the pool's last person.
    ([5] * 5, 1, 3, [[(0, 1, 5), (3, 0, 3), (4, 4, 5)], [(1, 0, 5), (3, 3, 5), (4, 0, 1)], [(2, 0, 5), (4, 1, 4)]], 1),
    # S < N: no whole shards, pool of 6 persons over 4 slots, q=1; 2 left out (shard 0's first two, slots 0 and 1's
    # slices), those two slots take the pool's last two.
    ([3] * 2, 4, 0, [[(1, 1, 2)], [(1, 2, 3)], [(0, 2, 3)], [(1, 0, 1)]], 2),
    # N divides S: whole shards only.
    ([7] * 4, 2, 2, [[(0, 0, 7)], [(1, 0, 7)], [(2, 0, 7)], [(3, 0, 7)]], 0),
]


@pytest.mark.parametrize(("sizes", "world", "k", "expected", "dropped"), HAND_CASES)
def test_train_plan_by_hand(sizes, world, k, expected, dropped):
    plan = assign(sizes, world, k, mode=EVEN, shuffle=False)
    assert [[(s.shard, s.start, s.stop) for s in segments] for segments in plan] == expected
    assert left_out(sizes, world, k, EVEN) == dropped


@pytest.mark.parametrize(("epoch", "expected"), [
    # 2 shards of 4 and a remainder of 3 (shard 2) over 2 slots: 11 persons, 1 left out, counted remainder first:
    # remainder person 0 in epoch 0, 1 in epoch 1, then shard 0's first person in epoch 3; each slot reads its
    # shard and one remainder person (slot 0 two when it lost one of its shard).
    (0, [[(0, 0, 4), (2, 1, 2)], [(1, 0, 4), (2, 2, 3)]]),
    (1, [[(0, 0, 4), (2, 0, 1)], [(1, 0, 4), (2, 2, 3)]]),
    (3, [[(0, 1, 4), (2, 0, 2)], [(1, 0, 4), (2, 2, 3)]]),
])
def test_train_plan_shares_the_remainder_by_hand(epoch, expected):
    plan = assign([4, 4], 2, 0, mode=EVEN, shuffle=False, epoch=epoch, remainder=3)
    assert [[(s.shard, s.start, s.stop) for s in segments] for segments in plan] == expected
    assert left_out([4, 4], 2, 0, EVEN, remainder=3) == 1
    assert len(left_out_segments([4, 4], 2, 0, epoch=epoch, remainder=3)) == 1


def test_shuffled_plan_uses_the_epoch_order():
    order = epoch_shard_order(5, seed=3, epoch=2).tolist()
    plan = assign([10] * 5, 2, 0, mode=EVEN, seed=3, epoch=2)
    assert plan[0] == [Segment(order[0], 0, 10), Segment(order[2], 0, 10), Segment(order[4], 0, 5)]
    assert plan[1] == [Segment(order[1], 0, 10), Segment(order[3], 0, 10), Segment(order[4], 5, 10)]


def test_inference_plan_and_batches_by_hand():
    plan = assign([5, 5, 5, 2], 2, 0, mode=COMPLETE, shuffle=True, seed=9)
    assert plan == [[Segment(0, 0, 5), Segment(2, 0, 5)], [Segment(1, 0, 5), Segment(3, 0, 2)]]
    assert rank_batches([5, 5, 5, 2], 2, 0, 4, mode=COMPLETE) == [3, 2]  # 10 persons -> 3, 7 persons -> 2


def test_counts_by_hand():
    assert num_slots(4, 0) == 4 and num_slots(2, 3) == 6
    assert slot_index(1, 2, 3) == 5 and slot_index(3, 0, 0) == 3
    assert num_batches(10, 4) == 3 and num_batches(10, 4, drop_last=True) == 2 and num_batches(0, 4) == 0
    assert rank_batches([10] * 5, 2, 0, 4, mode=EVEN) == [7, 7]  # 25 persons per slot
    assert rank_batches([10] * 5, 2, 0, 4, mode=EVEN, drop_last=True) == [6, 6]
    assert rank_batches([6] * 4, 1, 2, 5, mode=EVEN) == [6]  # two slots of 12 persons, 3 batches each
    assert batch_places(2, 4, 10) == range(8, 10) and len(batch_places(3, 4, 10)) == 0
    assert window_permutation(5, 1, 0, 0, 0).tolist() == [0, 1, 2, 3, 4]
    assert window_permutation(0, 4, 0, 0, 0).size == 0
    assert worker_batches_consumed(3, 2, [1, 3]) == [1, 2]  # w0, w1, w1
    assert worker_batches_consumed(3, 3, [2, 0, 2]) == [2, 0, 1]  # w0, w2, w0
    assert worker_batches_consumed(5, 0, []) == [5]
    assert worker_batches_consumed(5, 2, [5, 3], per_message=2) == [3, 2]  # w0 w0, w1 w1, w0 (of w0's 2nd message)
    assert worker_batches_consumed(7, 2, [5, 3], per_message=2) == [4, 3]  # ..., w0 w0, w1 (w1's short message)
    assert Segment(2, 3, 8).size == 5
    assert coverage([[Segment(0, 0, 4)], [Segment(0, 2, 6), Segment(1, 0, 1)]]) == (9, 7)


@pytest.mark.parametrize(
    "call",
    [
        lambda: assign([3, 4], 1, 0, mode=EVEN),
        lambda: assign([], 1, 0, mode=EVEN),
        lambda: assign([3], 1, 0, mode="eval"),
        lambda: assign([3], 0, 0, mode=EVEN),
        lambda: assign([3], 1, -1, mode=EVEN),
        lambda: slot_index(0, 2, 2),
        lambda: num_batches(3, 0),
        lambda: worker_batches_consumed(5, 2, [1, 3]),
        lambda: worker_batches_consumed(1, 2, [1]),
        lambda: worker_batches_consumed(1, 2, [1, 1], per_message=0),
        lambda: window_permutation(3, 0, 0, 0, 0),
    ],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()


def test_describe_exact_split():
    report = describe([100] * 8, 37, Topology(1, 2, 2), 32)
    assert report.ok
    assert "no overlap" in report.text and "all equal" in report.text
    assert "37" in report.text  # the remainder is mentioned
    # 837 persons over 4 slots: 209 each (200 of 2 whole shards, 9 of R), 1 left out, named: R's first person
    assert "836 read + 1 left out = 837 of 837" in report.text  # said "800 of 800": R was never read
    assert "left out of epoch 0: 1 persons (837 % 4 slots): R[0:1)" in report.text
    assert "EXACT: every slot reads 2 whole shard(s) and 9 persons of R; 1 persons are left out" in report.text
    assert "nothing is left out" not in report.text


def test_describe_validation_reads_everyone_or_refuses():
    report = describe([1] * 120, 80, Topology(1, 2, 2), 32, split="val", mode=EXACT)  # --shards 120 --num-val 200
    assert report.ok and "200 read + 0 left out = 200 of 200" in report.text
    assert "EXACT: every person once, 4 batches on every rank." in report.text
    refused = describe([1] * 4, 3, Topology(2, 4, 0), 32, split="val", mode=EXACT)  # 7 persons, 8 ranks
    assert not refused.ok and "REFUSED: 7 persons cannot each be read once" in refused.text


def test_describe_inexact_split_names_the_loss_and_the_fixes():
    # 10 shards over 1 x 3 GPUs, 0 workers: N=3, 9 whole shards, pool of 100 persons, q=33, and a remainder of 6:
    # 1006 persons, 1 left out.
    report = describe([100] * 10, 6, Topology(1, 3, 0), 16)
    assert not report.ok
    assert "1 persons per epoch are left out" in report.text
    assert "10 % 3 = 1" in report.text
    # K with 10 % (3K) == 0 for K in 1..16: none.
    assert "divide exactly for 1 x 3: none" in report.text
    # 10 shards over 2 ranks: K in {1, 5}.
    assert "divide exactly for 1 x 2: 1, 5" in describe([100] * 10, 0, Topology(1, 2, 2), 32).text


def test_describe_stays_short_for_many_slots():
    report = describe([50] * 256, 0, Topology(2, 8, 8), 32)  # 128 slots
    assert report.ok
    assert len(report.text.splitlines()) < 40
    assert "112 more slots" in report.text


# -- resume and window arithmetic (the reader only composes these) ------------------------------------------------
def segments_of(sizes: list[int], cuts: list[tuple[int, int]]) -> list[Segment[int]]:
    """A slot's stream: shard i from person a to b (a <= b <= sizes[i]), one segment per shard, in order."""
    return [Segment(i, min(a, b, n), min(max(a, b), n)) for i, (n, (a, b)) in enumerate(zip(sizes, cuts, strict=False))]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)), max_size=8),
       st.integers(1, 50), batches, st.booleans(), st.integers(0, 30), st.data())
def test_windows_cover_the_slot_from_batch_skip_on_in_order(cuts, window, batch, drop_last, skip, data):
    segments = segments_of([c[0] for c in cuts], [(a, b) for _, a, b in cuts])
    stream = [(s.shard, p) for s in segments for p in range(s.start, s.stop)]
    total = len(stream)
    cut = data.draw(st.integers(0, total) | st.just(total))  # where the slot's share of the pool starts
    first, last = min(skip * batch, total), min(num_batches(total, batch, drop_last) * batch, total)
    wins = list(windows(segments, window, batch, drop_last, skip, cut))
    got = [(s.shard, p) for w in wins for s in w.segments for p in range(s.start, s.stop)]
    if first >= last:
        assert wins == []
        return
    assert wins[0].start <= first < wins[0].stop and wins[-1].start < last <= wins[-1].stop
    assert got == stream[wins[0].start : wins[-1].stop]
    for w, nxt in zip(wins, wins[1:], strict=False):
        assert w.stop == nxt.start
    before = -(-cut // window)  # windows before the cut
    for w in wins:
        start, end = (w.index * window, cut) if w.index < before else (cut + (w.index - before) * window, total)
        assert w.start == start and w.size == min(window, end - start) == sum(s.size for s in w.segments)
        assert all(s.size > 0 for s in w.segments)


@given(worlds, workers, st.integers(1, 6), st.integers(1, 30), st.integers(0, 40), batches, seeds, epochs,
       st.integers(1, 300))
def test_ordered_windows_follow_the_window_permutation(world, k, num_shards, n, rem, batch, seed, epoch, window):
    """A slot's own persons follow window_permutation; its share of the pooled tail and remainder comes after them,
    in windows of its own, so that the share does not reorder them."""
    part = Partition((n,) * num_shards, world, k, EVEN, seed, True, batch, False, window, rem)
    slot = num_slots(world, k) - 1
    segments, cut = part.stream(slot, epoch)
    total = slot_persons(segments)
    got = [w.start + order for w, order in part.ordered_windows(slot, epoch, 0)]
    got = np.concatenate(got) if got else np.empty(0, np.int64)
    assert np.array_equal(got[:cut], window_permutation(cut, window, seed, epoch, slot))
    assert sorted(got[cut:].tolist()) == list(range(cut, total))
    assert sum(part.worker_batches(0)) == rank_batches(part.sizes, world, k, batch, mode=EVEN, remainder=rem)[0]


def test_the_share_of_the_remainder_leaves_the_own_persons_order_alone():
    """12 shards over 2 slots (the pinned dataset's layout): the remainder's share is read after each slot's own
    shards, which keep the order they had without it."""
    without = Partition((114,) * 12, 2, 0, EVEN, 3, True, 32, False, 4096)
    shared = Partition((114,) * 12, 2, 0, EVEN, 3, True, 32, False, 4096, remainder=57)
    for slot in (0, 1):
        (old,), new = list(without.ordered_windows(slot, 2, 0)), list(shared.ordered_windows(slot, 2, 0))
        assert new[0][0] == old[0] and np.array_equal(new[0][1], old[1])
        assert len(new) == 2 and new[1][0].start == 684 and new[1][0].segments[0].shard == 12


def loader_order(per_worker: list[int], per_message: int, roles: list[int], skips: list[int]) -> list[tuple[int, int]]:
    """(role, batch) in the order an in-order DataLoader returns them: worker k plays ``roles[k]`` from its batch
    ``skips[roles[k]]``, sending messages cut at multiples of ``per_message`` in its role's numbering; the loader
    asks worker 0, 1, ... in turn and skips exhausted ones."""
    queues = []
    for role in roles:
        batches_left = list(range(skips[role], per_worker[role]))
        msgs: list[list[int]] = []
        for b in batches_left:
            if not msgs or b % per_message == 0:
                msgs.append([])
            msgs[-1].append(b)
        queues.append([[(role, b) for b in m] for m in msgs])
    out = []
    while any(queues):
        for q in queues:
            if q:
                out += q.pop(0)
    return out


@given(st.lists(st.integers(0, 12), min_size=1, max_size=6), st.integers(1, 4), st.data())
def test_pass_roles_resume_the_loaders_order(per_worker, per_message, data):
    k = len(per_worker)
    whole = loader_order(per_worker, per_message, list(range(k)), [0] * k)
    n = data.draw(st.integers(0, len(whole)))
    roles = pass_roles(n, k, per_worker, per_message)
    assert sorted(r for r, _ in roles) == list(range(k))  # a permutation: every stream is read, once
    skips = [0] * k
    for role, skip in roles:
        skips[role] = skip
    assert sum(skips) == n
    assert loader_order(per_worker, per_message, [r for r, _ in roles], skips) == whole[n:]


def test_pass_roles_without_workers_and_pass_starts():
    assert pass_roles(7, 0, [12]) == [(0, 7)]
    assert first_due([2, 1], [2, 4], 1) == 1 and first_due([2, 4], [2, 4], 1) == 0  # all done: worker 0
    assert pass_start(5, 3, 0) == (5, 3) and pass_start(5, 3, 2) == (7, 0)  # only the first pass resumes
    assert resume_point(4, 9, 10) == (4, 9) and resume_point(4, 10, 10) == (5, 0) and resume_point(4, 0, 0) == (5, 0)


def test_old_mode_names_are_refused_naming_the_new_ones():
    with pytest.raises(ValueError, match=r"^mode='train' is renamed: use mode='balanced'$"):
        assign([10] * 5, 2, 1, mode="train", seed=3, epoch=2)
    with pytest.raises(ValueError, match=r"^mode='inference' is renamed: use mode='complete'$"):
        left_out([5, 5, 2], 2, 0, "inference")
    for old_name in ("TRAIN", "INFERENCE", "describe", "PlanReport"):
        with pytest.raises(AttributeError, match=f"has no attribute '{old_name}'"):
            getattr(plan_module, old_name)
    with pytest.raises(ValueError, match="mode must be 'balanced', 'complete' or 'exact'"):
        mode_name("eval")


def test_describe_counts_what_drop_last_drops():
    # 8 shards of 100 over 2 ranks x 2 workers: 200 persons a slot, 6 batches of 32 (192), 8 dropped a slot
    report = describe([100] * 8, 0, Topology(1, 2, 2), 32, drop_last=True)
    assert report.ok
    assert "batches per rank: 12" in report.text
    assert "drop_last drops 32 persons" in report.text
    assert "nothing is left out" not in report.text  # 32 persons are, each epoch


def test_describe_refuses_a_batch_larger_than_every_slot_with_drop_last():
    # 200 persons a slot, batch 300 with drop_last: every rank's epoch is empty (the reader yields no batch)
    report = describe([100] * 8, 0, Topology(1, 2, 2), 300, drop_last=True)
    assert not report.ok
    assert "batches per rank: 0" in report.text
    assert "NO BATCHES" in report.text and "--batch-size <= 200" in report.text
    assert "EXACT: every slot" not in report.text


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("gpus", "workers", "batch"), [(2, 2, 500), (2, 0, 100), (2, 2, 2000)])
def test_plan_numbers_are_what_the_reader_yields(nomlm_dataset: Path, gpus: int, workers: int, batch: int) -> None:
    """`shardify plan --drop-last`'s batches per rank and persons left out, against a real pass of every rank."""
    code, out = shardify("plan", nomlm_dataset, "--gpus", gpus, "--workers", workers, "--batch-size", batch,
                         "--drop-last")
    per_rank = int(re.search(r"batches per rank: (\d+)", out).group(1))
    total, left = map(int, re.search(r"read \+ (\d+) left out = \d+ of (\d+)", out).groups()[::-1])
    dropped = re.search(r"drop_last drops (\d+) persons", out)
    yielded = []
    for rank in range(gpus):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = ShardedDataset(nomlm_dataset, batch_size=batch, world=World(rank, gpus), num_workers=workers,
                                drop_last=True)
            got = list(ShardedLoader(ds, persistent_workers=False)) if workers else list(ds)
        assert len(got) == per_rank
        yielded += [b.tensors["person_id"] for b in got]
    ids = np.concatenate(yielded) if yielded else np.zeros(0, dtype=np.int64)
    assert len(np.unique(ids)) == len(ids) == total - left - (int(dropped.group(1)) if dropped else 0)
    assert code == (0 if per_rank else 1)


def test_plan_names_the_split_it_plans(nomlm_dataset: Path) -> None:
    code, out = shardify("plan", nomlm_dataset, "--split", "val", "--batch-size", 8)
    assert code == 0 and out.startswith("val split: 2 shards x 140 persons = 280")  # it said "train split"
    assert "mode exact (validation)" in out and "EXACT: every person once" in out  # as validation reads it


@pytest.mark.parametrize("args", [["--gpus", "0"], ["--gpus", "-1"], ["--batch-size", "0"], ["--nodes", "0"]])
def test_plan_option_refused(args: list[str], mlm_dataset: Path) -> None:
    assert_refused(*shardify("plan", mlm_dataset, "--batch-size", "8", *args), args[0])
