"""The performer bench, quick: tiny dims, both populations, both passes; its agreement check runs first, and the page
it writes names the commit and holds a row per (population, pass) with the bar computed from the padding."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import bench_performer

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]


def test_bench_writes_a_row_per_population_and_pass(tmp_path: Path) -> None:
    out = tmp_path / "performer.md"
    bench_performer.main(["--sizes", "tiny", "--persons", "6", "--batch", "3", "--rounds", "1", "--out", str(out)])
    text = out.read_text()
    assert f"at commit {bench_performer.commit()}" in text
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| tiny")]
    assert [(r[1].strip(), r[2]) for r in rows] == [("sample", "train"), ("sample", "predict"),
                                                     ("long-tail", "train"), ("long-tail", "predict")]
    for r in rows:
        padding, bar = float(r[3]), float(r[9])  # both printed to 2 decimals
        assert 0 < padding < 1 and 0.8 / (1.005 - padding) - 0.005 <= bar <= 0.8 / (0.995 - padding) + 0.005
        assert float(r[4]) > 0 and float(r[5]) > 0


def test_budget_batches_keep_the_order_and_the_budget() -> None:
    people = bench_performer.person_ids([5, 9, 3, 12, 1], vocab=50, seed=0)
    batches = bench_performer.budget_batches(people, 14)
    assert [[p.shape[1] for p in b] for b in batches] == [[5, 9], [3], [12, 1]]
