"""The population benchmark, tiny: every stage runs, the array's merge is the single conversion, and it writes its
table and plot."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tools import bench_population


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_stage_runs_at_a_tiny_size(tmp_path: Path) -> None:
    bench_population.main(["--persons", "2000", "2500", "--tasks", "3", "--scaling-up-to", "2000", "--embed-batches",
                           "1", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    with (tmp_path / "out" / "population.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    for size in ("2000",):
        mine = {r["stage"]: r for r in rows if r["population"] == size}
        assert list(mine) == ["synth", "convert-1", "convert-2", "array-3", "merge", "plan", "read", "embed"]
        kept = int(mine["convert-1"]["persons"])
        assert 0 < kept <= int(size)  # the seed's filter drops persons with fewer than 5 events
        assert int(mine["convert-2"]["persons"]) == int(mine["merge"]["persons"]) == kept
        assert int(mine["embed"]["persons"]) == bench_population.BATCH
        assert all(float(r["seconds"]) > 0 and float(r["peak_rss_mb"]) > 0 for r in mine.values()
                   if r["stage"] != "synth")
        assert int(mine["array-3"]["spill_bytes"]) > 0
        assert 0 < int(mine["array-3"]["encoded"]) < kept  # the slowest task encoded its share, not everyone
        assert all(float(r["cpu_s"]) > 0 and float(r["load"]) >= 0 for r in mine.values())
        assert float(mine["embed"]["first_batch_s"]) > 0
    above = [r["stage"] for r in rows if r["population"] == "2500"]  # no scaling stages above --scaling-up-to
    assert above == ["synth", "convert-1", "plan", "read", "embed"]
    assert not list((tmp_path / "work").iterdir())  # each size's files removed once measured
    assert (tmp_path / "out" / "population.png").stat().st_size > 0
