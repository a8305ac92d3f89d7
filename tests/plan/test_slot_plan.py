"""A worker's own slot, planned from its windows alone (plan/stream.py slot_stream, plan/balance.py plan_slot), is
the whole epoch's plan for that slot: the same persons in the same batches in the same order, for any lengths,
shards (empty ones included), arrangement, window and reshuffle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifeseq_shards.plan.balance import TokenPlan, plan_epoch, plan_slot, step_of
from lifeseq_shards.plan.budget import MIN_BUDGET_PERSONS
from lifeseq_shards.plan.resume import Arrangement
from lifeseq_shards.plan.stream import epoch_stream, stream_offsets, stream_persons, window_tokens
from lifeseq_shards.plan.tokens import TokenSchedule


@st.composite
def cases(draw: st.DrawFn) -> dict:
    longest_cap = draw(st.integers(1, 30))
    sizes = draw(st.lists(st.integers(0, 60), min_size=1, max_size=12))
    if sum(sizes) == 0:
        sizes[0] = 1
    n = sum(sizes)
    lengths = np.array(draw(st.lists(st.integers(1, longest_cap), min_size=n, max_size=n)))
    return {"lengths": lengths, "sizes": sizes, "world": draw(st.integers(1, 5)), "workers": draw(st.integers(0, 3)),
            "budget": draw(st.integers(MIN_BUDGET_PERSONS * int(lengths.max()), 10 * int(lengths.max()))),
            "window": draw(st.integers(1, 40)), "seed": draw(st.integers(0, 3)), "epoch": draw(st.integers(0, 3)),
            "shuffle": draw(st.booleans())}


def slot_of_plan(plan: TokenPlan, rank: int, worker: int) -> list[np.ndarray]:
    """Batch j of rank ``rank``'s worker ``worker`` as the whole plan has it: at the rank's step step_of(worker, j)."""
    lay = plan.arrangement
    per = plan.steps // lay.workers
    return [plan.batch(int(step_of(worker, j, per, lay.workers, lay.batches_per_message)), rank) for j in range(per)]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_slot_planned_alone_is_the_whole_plans_slot(c: dict) -> None:
    kw = {"seed": c["seed"], "epoch": c["epoch"], "shuffle": c["shuffle"]}
    lay = Arrangement.of_budget(c["budget"], c["world"], c["workers"], window=c["window"], batches_per_message=2)
    try:
        plan = plan_epoch(c["lengths"], c["sizes"], lay, **kw)
    except ValueError:  # an arrangement the plan refuses (too few tokens for the ranks): plan_slot refuses it too
        with pytest.raises(ValueError):
            plan_slot(c["lengths"], c["sizes"], lay, 0, **kw)
        return
    k = max(1, c["workers"])
    for rank in range(c["world"]):
        for worker in range(k):
            alone = plan_slot(c["lengths"], c["sizes"], lay, rank * k + worker, **kw)
            whole = slot_of_plan(plan, rank, worker)
            assert len(alone) == len(whole)
            for a, b in zip(alone, whole, strict=True):
                assert np.array_equal(a, b)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_window_tokens_are_the_streams_sums(c: dict) -> None:
    stream = epoch_stream(c["sizes"], c["seed"], c["epoch"], c["window"], c["shuffle"])
    sums = [int(c["lengths"][stream[lo : lo + c["window"]]].sum()) for lo in range(0, len(stream), c["window"])]
    for chunk in (1, 7, 1 << 20):  # summed a chunk of the lengths at a time, whatever the chunk
        got = window_tokens(c["lengths"], c["sizes"], c["seed"], c["epoch"], c["window"], c["shuffle"], chunk)
        assert got.tolist() == np.concatenate([[0], np.cumsum(sums)]).tolist()
    # and the stream's places are those stream_offsets gives, window by window
    places = stream + np.repeat(stream_offsets(c["sizes"], c["seed"], c["epoch"], c["shuffle"]), c["sizes"])[stream]
    assert (places // c["window"]).tolist() == sorted((places // c["window"]).tolist())


def test_many_slots_of_a_large_split() -> None:
    """Slots far smaller than a window and windows far smaller than a slot, on lengths like the researchers'."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(332), 0.6, 30_000), 6, 511).astype(np.int64)
    sizes = [1_000] * 29 + [1_000 - 7, 7]
    for world, workers, window in ((8, 2, 4096), (3, 1, 64)):
        lay = Arrangement.of_budget(20_000, world, workers, window=window)
        plan = plan_epoch(lengths, sizes, lay, seed=5, epoch=2)
        for rank in range(world):
            for worker in range(workers):
                alone = plan_slot(lengths, sizes, lay, rank * workers + worker, seed=5, epoch=2)
                assert all(np.array_equal(a, b) for a, b in zip(alone, slot_of_plan(plan, rank, worker), strict=True))


def test_a_slot_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 4 out of range for 4 slots"):
        plan_slot(np.full(400, 5), [400], Arrangement.of_budget(100, 2, 2), 4)


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(0, 2**32 - 1))
def test_positions_of_few_persons_and_of_many(c: dict, pick: int) -> None:
    """A worker's few persons are found by a search of the shards, a whole stream by a gather: the same places."""
    schedule = TokenSchedule(c["lengths"], tuple(c["sizes"]), c["seed"], c["shuffle"])
    stream = epoch_stream(c["sizes"], c["seed"], c["epoch"], c["window"], c["shuffle"])
    unshuffled = np.empty(len(stream), dtype=np.int64)
    unshuffled[stream_persons(c["sizes"], c["seed"], c["epoch"], 0, len(stream), c["shuffle"])] = np.arange(
        len(stream))
    few = np.random.default_rng(pick).choice(len(stream), size=max(1, len(stream) // 10), replace=False)
    for persons in (few, stream):
        assert schedule.places(c["epoch"], persons).tolist() == unshuffled[persons].tolist()
