"""The token-budget epoch as the reader runs it (plan/tokens.py): an epoch resumed after any step, in any sequence
of arrangements and budgets, trains every person exactly once, every rank the same steps, ending where an ordinary epoch
of the last arrangement ends; and the windows a worker reads hold exactly its batches' persons."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifeseq_shards.plan.balance import ATTENTION, TOKENS, plan_epoch
from lifeseq_shards.plan.resume import Arrangement, Leg
from lifeseq_shards.plan.tokens import TokenSchedule

LONGEST = 60


def arrangement(ranks: int, workers: int, budget: int, per_message: int = 1, window: int = 64) -> Arrangement:
    return Arrangement.of_budget(budget, ranks, workers, window=window, batches_per_message=per_message)


arrangements = st.builds(arrangement, st.integers(1, 4), st.integers(0, 3), st.integers(4 * LONGEST, 12 * LONGEST),
                    st.integers(1, 3), st.sampled_from([16, 64, 1000]))


@st.composite
def schedules(draw: st.DrawFn) -> TokenSchedule:
    sizes = draw(st.lists(st.integers(1, 60), min_size=2, max_size=12))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    lengths = rng.integers(1, LONGEST + 1, sum(sizes))
    lengths[0] = LONGEST  # the longest person is known
    return TokenSchedule(lengths, tuple(sizes), seed=draw(st.integers(0, 5)), shuffle=draw(st.booleans()),
                         cost=draw(st.sampled_from([TOKENS, ATTENTION])))


def trained(plan, first: int, last: int) -> list[int]:
    """The persons of steps [first, last) of ``plan``, on every rank."""
    return plan.persons[plan.bounds[first * plan.world_size] : plan.bounds[last * plan.world_size]].tolist()


@settings(max_examples=150, deadline=None)
@given(schedules(), st.lists(st.tuples(arrangements, st.floats(0, 1)), min_size=1, max_size=3), arrangements,
       st.integers(0, 3))
def test_any_sequence_of_resumes_trains_everyone_once(sched: TokenSchedule, stops: list[tuple[Arrangement, float]],
                                                      last: Arrangement, epoch: int) -> None:
    history: list[Leg] = []
    seen: list[int] = []
    for lay, where in stops:
        try:
            plan, base = sched.leg(epoch, history, lay)
        except ValueError:  # a split or rest too small for the arrangement: refused, never read unequally
            return
        assert base + plan.steps == sched.steps(lay)  # the rest ends where an ordinary epoch ends
        taken = int(where * plan.steps)
        seen += trained(plan, 0, taken)
        history.append(Leg(lay, base + taken))
    try:
        plan, base = sched.leg(epoch, history, last)
    except ValueError:
        return
    assert base + plan.steps == sched.steps(last)
    seen += trained(plan, 0, plan.steps)
    assert sorted(seen) == list(range(len(sched.lengths)))
    sizes = plan.batch_sizes()
    assert (sizes >= 1).all()  # every rank a person at every step
    assert (plan.step_costs(sched.lengths).max(axis=1) <= last.tokens_per_batch).all()


def test_an_ordinary_epoch_is_plan_epochs_plan() -> None:
    lengths = np.random.default_rng(3).integers(1, 100, 900)
    sizes = (100,) * 8 + (100,)
    sched = TokenSchedule(lengths, sizes, seed=4)
    lay = arrangement(3, 2, 1200, per_message=2, window=128)
    plan, base = sched.leg(5, (), lay)
    want = plan_epoch(lengths, sizes, lay, seed=4, epoch=5)
    assert base == 0 and np.array_equal(plan.persons, want.persons) and np.array_equal(plan.bounds, want.bounds)


def test_a_checkpoint_past_its_leg_is_refused() -> None:
    sched = TokenSchedule(np.full(400, 10), (100,) * 4)
    lay = arrangement(2, 0, 100)
    steps = sched.steps(lay)
    with pytest.raises(ValueError, match=f"took batch {steps + 1} of epoch 0.*0..{steps}"):
        sched.leg(0, [Leg(lay, steps + 1)], arrangement(3, 0, 100))


def test_a_rest_too_small_for_the_new_ranks_is_refused() -> None:
    sched = TokenSchedule(np.full(400, 10), (100,) * 4)
    lay = arrangement(2, 0, 100)
    # one step left: 2 ranks' worth of persons, never enough to give 8 ranks x 3 workers a person at every step
    with pytest.raises(ValueError, match="too few to give each of 8 ranks a person"):
        sched.leg(0, [Leg(lay, sched.steps(lay) - 1)], arrangement(8, 3, 100))


@settings(max_examples=100, deadline=None)
@given(schedules(), arrangements, st.integers(0, 3), st.data())
def test_a_workers_windows_hold_its_batches_persons(sched: TokenSchedule, lay: Arrangement, epoch: int,
                                                   data: st.DataObject) -> None:
    try:
        plan, _ = sched.leg(epoch, (), lay)
    except ValueError:
        return
    rank = data.draw(st.integers(0, lay.world_size - 1))
    worker = data.draw(st.integers(0, lay.workers - 1))
    batches = [plan.batch(int(s), rank) for s in plan.worker_steps(worker)]
    # the split's persons in the epoch's unshuffled stream, as the shards lie on disk
    starts = np.cumsum(sched.shard_sizes) - np.asarray(sched.shard_sizes)
    got: list[int] = []
    last = -1
    for win, index in sched.ordered_windows(epoch, lay.window, batches):
        assert win.index > last  # each window once, in stream order
        last = win.index
        on_disk = [starts[s.shard] + p for s in win.segments for p in range(s.start, s.stop)]
        assert len(on_disk) == win.size
        got += [on_disk[i] for i in index]
    # batch after batch, each batch's persons in some order
    cuts = np.cumsum([len(b) for b in batches])[:-1]
    assert [sorted(p) for p in np.split(np.array(got, dtype=np.int64), cuts)] == [sorted(b.tolist()) for b in batches]
