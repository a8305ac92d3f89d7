"""A restored OneCycleLR fitted to the steps a fit resumed in another arrangement has left.

A checkpoint's OneCycleLR was sized for the arrangement that saved it (``total_steps`` from that run's
``estimated_stepping_batches``). Resumed on other ranks, workers or batch size, the fit takes another number of steps:
more, and the scheduler stops it with ``Tried to step ... times``; fewer, and the run ends before the learning rate
has annealed. :func:`resize_one_cycle` stretches the cycle to this arrangement's count, at the same point of its course.
"""

from __future__ import annotations

from torch.optim.lr_scheduler import OneCycleLR


def resize_one_cycle(scheduler: OneCycleLR, done: int, total: int) -> bool:
    """Make ``scheduler`` a cycle of ``total`` steps of which ``done`` are taken (its phases scaled, each at the
    same share of the cycle), and set the optimizer's learning rate (and momentum) for the next step. Nothing
    changes when it already is one (a fresh fit, or one resumed in its own arrangement). Returns whether it changed."""
    if (scheduler.total_steps, scheduler.last_epoch) == (total, done):
        return False
    if not 0 <= done <= total:
        raise ValueError(f"resize_one_cycle: {done} steps taken of {total}")
    scale = total / scheduler.total_steps
    phases = scheduler._schedule_phases
    for i, phase in enumerate(phases[:-1]):  # phase i ends at (i + 1) * pct * total - (i + 1)
        phase["end_step"] = (phase["end_step"] + i + 1) * scale - (i + 1)
    phases[-1]["end_step"] = total - 1
    scheduler.total_steps, scheduler.last_epoch = total, done
    scheduler._get_lr_called_within_step = True  # as step() does: get_lr() is meant to be called from there
    try:
        lrs = scheduler.get_lr()  # sets the momentum too, when the cycle has one
    finally:
        scheduler._get_lr_called_within_step = False
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return True
