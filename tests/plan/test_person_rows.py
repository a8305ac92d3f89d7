"""person_rows: the most persons a batch within a token budget can hold, the person rows of a static batch shape.
It must bound every batch the token-budget plan makes, in every epoch, and be the least such bound over all
batches the budget allows (the shortest persons that fit, which a plan could put together)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifeseq_shards.plan.balance import person_rows, plan_epoch
from lifeseq_shards.plan.budget import MIN_BUDGET_PERSONS
from lifeseq_shards.plan.resume import Arrangement


@st.composite
def budgets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    n = draw(st.integers(1, 300))
    lengths = np.array(draw(st.lists(st.integers(1, draw(st.integers(1, 40))), min_size=n, max_size=n)))
    return lengths, draw(st.integers(MIN_BUDGET_PERSONS * int(lengths.max()), 12 * int(lengths.max())))


@settings(max_examples=150)
@given(budgets(), st.integers(1, 3), st.integers(0, 2), st.integers(0, 3))
def test_every_planned_batch_fits_the_slots(case: tuple[np.ndarray, int], world: int, workers: int,
                                           epoch: int) -> None:
    lengths, budget = case
    slots = person_rows(lengths, budget)
    try:
        lay = Arrangement.of_budget(budget, world, workers, window=5)
        plan = plan_epoch(lengths, [len(lengths)], lay, seed=1, epoch=epoch)
    except ValueError:  # an arrangement the plan refuses: nothing to bound
        return
    assert plan.batch_sizes().max() <= slots


@settings(max_examples=300)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9), st.integers(1, 60))
def test_slots_are_the_largest_subset_within_the_budget(lengths: list[int], budget: int) -> None:
    """Against every subset of the persons (brute force): the largest whose tokens stay within the budget."""
    best = max(k for k in range(len(lengths) + 1)
               if any(sum(c) <= budget for c in itertools.combinations(lengths, k)))
    assert person_rows(np.array(lengths), budget) == best


def test_slots_do_not_depend_on_the_order() -> None:
    lengths = np.random.default_rng(0).integers(1, 500, 10_000)
    assert person_rows(lengths, 4096) == person_rows(lengths[::-1], 4096) == person_rows(np.sort(lengths), 4096)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="tokens_per_batch=0"):
        person_rows(np.array([3, 4]), 0)
    with pytest.raises(ValueError, match="length 0"):
        person_rows(np.array([3, 0]), 10)
