"""The DDP wait benchmark, tiny: its persons plan is the reader's, and a run of 2 gloo ranks writes its tables with
every person trained once an epoch in both plans and the token-budget plan's ranks the closer in tokens."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from lifeseq_shards.plan.compare import persons_left_out, persons_plan_costs
from tools import bench_ddp_wait
from tools.common import sample_lengths, shards_of

pytestmark = [pytest.mark.bench]
LIMIT = 1101  # a shard and a remainder: a dozen steps a plan at 2 ranks x 50 persons; the persons plan leaves 1 out


@pytest.mark.parametrize("ranks", [2, 4])
def test_persons_plan_batches_are_the_readers(sample: Path, ranks: int) -> None:
    lengths = sample_lengths(sample)
    sizes = shards_of(len(lengths))
    batches = bench_ddp_wait.persons_plan_batches(lengths, sizes, ranks, bench_ddp_wait.WORKERS, 50, epoch=1)
    costs = np.array([[lengths[ids].sum() for ids in step] for step in batches])
    assert np.array_equal(costs, persons_plan_costs(lengths, sizes, ranks, bench_ddp_wait.WORKERS, 50, epoch=1))
    every = np.concatenate([ids for step in batches for ids in step])
    assert len(np.unique(every)) == len(every) == len(lengths) - persons_left_out(sizes, ranks,
                                                                                   bench_ddp_wait.WORKERS)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
@pytest.mark.timeout(120)  # the ranks are killed at --timeout 90 before this
def test_tiny_run_trains_everyone_once_and_balances_tokens(tmp_path: Path, sample: Path) -> None:
    bench_ddp_wait.main(["--out", str(tmp_path), "--sample", str(sample), "--ranks", "2", "--limit", str(LIMIT),
                         "--epochs", "1", "--rounds", "2", "--timeout", "90"])
    summary = {r["mode"]: r for r in rows(tmp_path / "balance-ddp.csv")}
    assert set(summary) == set(bench_ddp_wait.MODES)
    old, new = summary["persons"], summary["tokens"]
    # what the ranks report they trained: the tokens plan everyone, the persons plan all but its left-out few
    left = persons_left_out(shards_of(LIMIT), 2, bench_ddp_wait.WORKERS)
    assert new["persons_trained"] == new["persons_distinct"] == str(LIMIT) and new["persons_left_out"] == "0"
    assert old["persons_trained"] == old["persons_distinct"] == str(LIMIT - left)
    assert old["persons_left_out"] == str(left)
    assert 1 <= float(new["tokens_max_min"]) < float(old["tokens_max_min"])
    for s in summary.values():
        assert 0 < float(s["compute_s"]) < float(s["step_s"]) and 0 < float(s["own_s"])
        assert 0 <= float(s["wait_clock_s"]) and 0 <= float(s["wait_share"]) < 1
    assert float(new["step_s_ratio"]) == pytest.approx(float(new["step_s"]) / float(old["step_s"]), rel=1e-3)

    steps = rows(tmp_path / "balance-ddp-steps.csv")
    per_mode = {m: int(summary[m]["steps_per_epoch"]) * 2 for m in bench_ddp_wait.MODES}  # x 2 ranks
    assert {m: sum(r["mode"] == m for r in steps) for m in per_mode} == per_mode
    by_step: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in steps:
        by_step.setdefault((r["mode"], r["step"]), []).append(r)
    for pair in by_step.values():
        assert sorted(r["rank"] for r in pair) == ["0", "1"]
        assert max(float(r["compute_s"]) for r in pair) <= float(pair[0]["step_s"])
        assert min(float(r["wait_clock_s"]) for r in pair) == 0.0  # the last rank to arrive waits for nobody
    fits = rows(tmp_path / "balance-ddp-fit.csv")
    assert {(f["points"], f["clock"]) for f in fits} == {(p, c) for p in ("calibration", "steps")
                                                         for c in ("wall", "cpu")}
    calibration = next(f for f in fits if (f["points"], f["clock"]) == ("calibration", "cpu"))
    assert float(calibration["us_per_token"]) > 0  # compute grows with tokens over 0.2-2x the batch
    text = (tmp_path / "balance-ddp.md").read_text()
    assert "## Method" in text and "| 2 | 50 | tokens |" in text and "a GPU run waits" in text
    assert (tmp_path / "balance-ddp.png").read_bytes()[:4] == b"\x89PNG"
