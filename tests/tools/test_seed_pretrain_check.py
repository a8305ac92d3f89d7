"""tools/seed_pretrain_check.py's verdicts on recorded runs: a resume that replays or skips a batch fails, an exact one
passes, and the records a SIGKILL cuts read as the steps they hold. (The check itself needs the researchers'
repository, which CI does not have: docs/results/seed-pretrain.md has its runs.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.seed_pretrain_check import CheckFailed, Records, compare_resumed, last_steps, read_records

PER_EPOCH, EPOCHS, BATCH = 4, 2, 3


def step_line(rank: int, step: int) -> dict[str, Any]:
    """What the recorder writes for ``step`` of an uninterrupted run: each rank's batch of BATCH persons."""
    epoch, batch = divmod(step - 1, PER_EPOCH)
    first = ((batch * 2 + rank) * BATCH + epoch * 7) % (2 * PER_EPOCH * BATCH)
    return {"epoch": epoch, "step": step, "batch": batch, "ids": [first + i for i in range(BATCH)],
            "loss": float(10 - step / 3).hex(), "lr": float(step / 100).hex()}


def run(steps: range, shift: int = 0) -> Records:
    """Records of ``steps``; with ``shift``, each step training on the persons of ``step + shift`` (a loader off
    by one while Lightning counts right: -1 replays a batch, 1 skips one)."""
    return {r: {s: {**step_line(r, s), "ids": step_line(r, s + shift)["ids"]} for s in steps} for r in range(2)}


FULL = run(range(1, PER_EPOCH * EPOCHS + 1))
SAVED = PER_EPOCH + 2  # mid-epoch 1


def test_an_exact_resume_passes() -> None:
    killed = run(range(1, SAVED + 3))  # killed two steps after the checkpoint
    compare_resumed(FULL, killed, run(range(SAVED + 1, PER_EPOCH * EPOCHS + 1)), SAVED)


@pytest.mark.parametrize("shift", [-1, 1], ids=["replayed", "skipped"])
def test_a_resume_off_by_one_batch_fails(shift: int) -> None:
    resumed = run(range(SAVED + 1, PER_EPOCH * EPOCHS + 1), shift=shift)
    with pytest.raises(CheckFailed, match=f"rank 0 step {SAVED + 1}: ids differs"):
        compare_resumed(FULL, run(range(1, SAVED + 3)), resumed, SAVED)


def test_a_resume_that_ends_early_or_restarts_late_fails() -> None:
    with pytest.raises(CheckFailed, match=r"steps \[8\] missing"):
        compare_resumed(FULL, run(range(1, SAVED + 1)), run(range(SAVED + 1, PER_EPOCH * EPOCHS)), SAVED)
    with pytest.raises(CheckFailed, match=r"steps \[7\] missing"):
        compare_resumed(FULL, run(range(1, SAVED + 1)), run(range(SAVED + 2, PER_EPOCH * EPOCHS + 1)), SAVED)


def test_other_losses_or_learning_rates_fail() -> None:
    for key in ("loss", "lr"):
        resumed = run(range(SAVED + 1, PER_EPOCH * EPOCHS + 1))
        resumed[1][SAVED + 2][key] = float(1).hex()
        with pytest.raises(CheckFailed, match=f"rank 1 step {SAVED + 2}: {key} differs"):
            compare_resumed(FULL, run(range(1, SAVED + 1)), resumed, SAVED)


def write(records: Path, rank: int, lines: list[str]) -> None:
    records.mkdir(exist_ok=True)
    (records / f"rank{rank}.jsonl").write_text("".join(lines))


def test_records_cut_by_a_sigkill_read_as_their_whole_lines(tmp_path: Path) -> None:
    lines = [json.dumps(step_line(0, s)) + "\n" for s in (1, 2, 3)]
    write(tmp_path, 0, [*lines[:2], lines[2][:20]])  # the third line half written
    write(tmp_path, 1, lines)
    assert sorted(read_records(tmp_path)[0]) == [1, 2]
    assert last_steps(tmp_path) == [2, 3]


def test_a_step_recorded_twice_is_refused(tmp_path: Path) -> None:
    line = json.dumps(step_line(0, 1)) + "\n"
    write(tmp_path, 0, [line, line])
    write(tmp_path, 1, [])
    with pytest.raises(CheckFailed, match="rank 0 recorded step 1 twice"):
        read_records(tmp_path)
