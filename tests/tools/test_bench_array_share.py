"""The array-share benchmark, tiny: the single conversion and the tasks run, each task encodes less than everyone,
and the phases add up to no more than the whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_array_share

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]


def test_each_task_costs_its_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench_array_share.main(["--persons", "3000", "--tasks", "2", "3", "--work", str(tmp_path / "w"), "--out",
                            str(tmp_path / "share.csv")])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tasks"], r["task"]) for r in rows] == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 2), (1, 0)]
    pool = rows.pop()  # the single conversion with 2 processes: its own CPU and its workers'
    assert pool["parent"] > 0 and pool["workers"] > 0 and pool["cpu_s"] == pytest.approx(pool["parent"]
                                                                                         + pool["workers"], abs=0.02)
    single = rows[0]
    assert single["survey"] == 0 and single["encoded"] == single["persons"] and single["of_single"] == 1
    for r in rows[1:]:
        assert r["survey"] > 0 and 0 < r["encoded"] < single["persons"]
        assert r["survey"] + r["encode"] + r["pass2"] <= r["cpu_s"] + 0.05
    assert (tmp_path / "share.csv").read_text().startswith("persons,tasks,task,encoded,cpu_s")
    assert not (tmp_path / "w").exists()
