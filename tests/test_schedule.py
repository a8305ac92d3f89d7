"""resize_one_cycle: a restored OneCycleLR continued over the steps another arrangement has left."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

from lifeseq_shards.schedule import resize_one_cycle


def cycle(total: int, steps: int, three_phase: bool = False) -> OneCycleLR:
    """A OneCycleLR of ``total`` steps (the seed's settings) after ``steps`` optimizer steps."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = OneCycleLR(optimizer, max_lr=1e-3, total_steps=total, three_phase=three_phase, pct_start=0.05,
                           div_factor=30)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler


def lrs(scheduler: OneCycleLR, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize(("total", "steps", "new_total", "new_done"), [(100, 40, 200, 80), (200, 90, 120, 54),
                                                                       (100, 3, 300, 9)])
def test_a_resized_cycle_is_the_cycle_of_the_new_length(total: int, steps: int, new_total: int, new_done: int,
                                                        three_phase: bool) -> None:
    """Restored with more (or fewer) steps left: from then on, exactly the cycle sized for the new count; without
    the resize, a run with more steps left stops with OneCycleLR's 'Tried to step' error."""
    restored = cycle(total, steps, three_phase)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "use get_last_lr()" warning
        assert resize_one_cycle(restored, new_done, new_total)
    want = cycle(new_total, new_done, three_phase)
    assert restored.get_last_lr() == pytest.approx(want.get_last_lr(), rel=1e-9)
    assert restored.optimizer.param_groups[0]["betas"] == pytest.approx(want.optimizer.param_groups[0]["betas"])
    assert lrs(restored, new_total - new_done) == pytest.approx(lrs(want, new_total - new_done), rel=1e-9)
    if new_total - new_done > total - steps:
        with pytest.raises(ValueError, match="Tried to step"):
            lrs(cycle(total, steps, three_phase), new_total - new_done + 1)


def test_the_same_arrangement_changes_nothing() -> None:
    scheduler = cycle(100, 40)
    before = scheduler.state_dict()
    assert not resize_one_cycle(scheduler, 40, 100)
    assert scheduler.state_dict() == before
    with pytest.raises(ValueError, match="41 steps taken of 40"):
        resize_one_cycle(scheduler, 41, 40)
