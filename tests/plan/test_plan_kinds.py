"""Which plan forms an epoch's batches is asked of the plans themselves (``plan.epoch.plan_kind``, each class's
``wanted``): a reader's options and ``shardify plan``'s flags reach the same class, and a new way of forming batches
is one more ``EpochPlan`` class, chosen without a line changed elsewhere."""

from __future__ import annotations

import gc

import pytest

from lifeseq_shards.plan.asked import Asked
from lifeseq_shards.plan.epoch import BudgetPlan, EpochPlan, PersonsPlan, plan_kind
from lifeseq_shards.plan.report import PlanReport
from lifeseq_shards.reader.options import ReadOptions


@pytest.mark.parametrize(("asked", "kind"), [
    (Asked(256), PersonsPlan),
    (Asked(None, 8000), BudgetPlan),
    (Asked(64, 8000, "attention"), BudgetPlan),
    (ReadOptions(batch_size=8).asked, PersonsPlan),
    (ReadOptions(tokens_per_batch=4096, balance="attention", crop=300).asked, BudgetPlan),
], ids=["persons", "budget", "budget-with-batch", "options-persons", "options-budget"])
def test_the_plan_asked_for(asked: Asked, kind: type[EpochPlan]) -> None:
    assert plan_kind(asked) is kind


def test_options_are_asked_as_given() -> None:
    opts = ReadOptions(batch_size=8, tokens_per_batch=4096, balance="attention", pad_to=300)
    assert opts.asked == Asked(8, 4096, "attention", "balanced", False, 300)


def test_each_plan_refuses_what_it_cannot_read() -> None:
    """A budget's refusals, in a reader's words and in `shardify plan`'s; the persons plan refuses a balance only
    as flags (a reader's validation loader keeps the training loader's balance, unused)."""
    assert "tokens_per_batch is for training batches" in (BudgetPlan.refusal(Asked(8, 4096, mode="exact")) or "")
    assert "drop_last with tokens_per_batch" in (BudgetPlan.refusal(Asked(8, 4096, drop_last=True)) or "")
    assert BudgetPlan.refusal(Asked(8, 4096)) is None
    assert "--split val is read as validation" in (BudgetPlan.flag_refusal(Asked(8, 4096, mode="exact"), "val") or "")
    assert PersonsPlan.refusal(Asked(8, balance="attention")) is None
    assert "it needs --tokens-per-batch" in (PersonsPlan.flag_refusal(Asked(8, balance="attention"), "train") or "")
    assert "needs --batch-size" in (PersonsPlan.flag_refusal(Asked(None), "train") or "")
    assert PersonsPlan.flag_refusal(Asked(8), "train") is None


def test_a_new_plan_is_one_class() -> None:
    """A class that refines a plan for the requests it wants is chosen for them (and its parent for the rest); two
    unrelated plans that want one request are a TypeError naming both, not a silent choice."""

    class Grouped(PersonsPlan):
        """Batches of persons of similar length, asked here as ``balance="grouped"``: only its choice is exercised."""

        @classmethod
        def wanted(cls, asked: Asked) -> bool:
            return super().wanted(asked) and asked.balance == "grouped"

    class Rival(EpochPlan):
        """Claims the budget's requests beside BudgetPlan."""

        @classmethod
        def wanted(cls, asked: Asked) -> bool:
            return bool(asked.tokens_per_batch)

    try:
        assert plan_kind(Asked(8, balance="grouped")) is Grouped
        assert plan_kind(Asked(8)) is PersonsPlan
        with pytest.raises(TypeError, match=r"wanted by \['BudgetPlan', 'Rival'\]"):
            plan_kind(Asked(8, 4096))
    finally:
        del Grouped, Rival
        gc.collect()  # classes hold reference cycles: only a collection drops them from __subclasses__()
    assert plan_kind(Asked(8, balance="grouped")) is PersonsPlan and plan_kind(Asked(8, 4096)) is BudgetPlan


def test_a_refused_budget_exits_2_and_a_plan_with_problems_1() -> None:
    assert [PlanReport(True, "").status, PlanReport(False, "").status, PlanReport(False, "", refused=True).status] \
        == [0, 1, 2]
