"""The lengths benchmark, quick: it times both ways on a converted population and prints a row a split."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import bench_lengths

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]


def test_bench_prints_a_row_a_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench_lengths.main(["--work", str(tmp_path), "--synth", "3000", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == bench_lengths.HEADER.splitlines()
    rows = [line.split(" | ") for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("| synth 3,000", "train"), ("| synth 3,000", "val")]
    for r in rows:
        assert int(r[4].replace(",", "")) == 2 * int(r[2].replace(",", ""))  # 2 bytes a person
        assert float(r[5]) > 0 and float(r[6]) > 0 and r[7].endswith("x |")
