"""The static-shapes benchmark, quick: every contender runs over a short token-budget epoch, the static batches'
losses are the varying ones' (the tool checks), the compiled step compiles once with the static shape and more
often without it, and the report is written."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tools import bench_static


@pytest.mark.bench
def test_the_benchmark_counts_one_compile_for_static_shapes(vocab_dataset: Path, tmp_path: Path) -> None:
    # backend "eager": dynamo traces and counts graphs as with inductor, without generating code
    bench_static.main(["--data", str(vocab_dataset), "--split", "val", "--tokens-per-batch", "2720", "--steps", "6",
                       "--backend", "eager", "--out", str(tmp_path)])
    with (tmp_path / "static-shapes.csv").open() as fh:
        rows = {(r["mode"], r["shapes"]): r for r in csv.DictReader(fh)}
    assert set(rows) == set(bench_static.CONTENDERS)
    assert all(r["steps"] == "6" for r in rows.values())
    assert rows["eager", "static"]["compiles"] == rows["eager", "varying"]["compiles"] == "0"
    assert rows["compiled", "static"]["compiles"] == "1"
    assert int(rows["compiled", "varying"]["compiles"]) > 1
    report = (tmp_path / "static-shapes.md").read_text()
    assert "StaticShape(tokens=2720, persons=" in report and "| compiled | static | 6 | 1 |" in report
