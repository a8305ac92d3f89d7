"""The performer bench, quick: tiny dims, both populations, both passes; its agreement check runs first, and the page
it writes names the commit and holds a row per (population, pass) with the bar computed from the padding.
tools/device_check.sh's ``their`` stage, as its CPU dry run at the smallest sizes: a page per precision, and a
non-zero exit without their dependencies or with a size the bench refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, scaled

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


def test_their_exp_clamped_is_named_and_undone(tmp_path: Path) -> None:
    """``--their-exp clamped`` times their model with the clamped exponents (its agreement check still passes: the
    same bits), says so on the page, and leaves performer-pytorch's module as it found it."""
    import performer_pytorch.performer_pytorch as theirs

    out = tmp_path / "performer.md"
    bench_performer.main(["--sizes", "tiny", "--populations", "sample", "--persons", "4", "--batch", "2", "--rounds",
                          "1", "--their-exp", "clamped", "--out", str(out)])
    assert "--their-exp clamped`" in out.read_text()
    assert theirs.torch is __import__("torch")


def test_budget_batches_keep_the_order_and_the_budget() -> None:
    people = bench_performer.person_ids([5, 9, 3, 12, 1], vocab=50, seed=0)
    batches = bench_performer.budget_batches(people, 14)
    assert [[p.shape[1] for p in b] for b in batches] == [[5, 9], [3], [12, 1]]


SMALLEST = {"THEIR_PERSONS": "2", "THEIR_BATCH": "1", "THEIR_ROUNDS": "1"}  # tiny dims, the sample's lengths (defaults)
STAGE_S = 60  # three interpreters importing torch (+ performer-pytorch), two benches of 2 persons


def their_stage(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    return subprocess.run(["bash", "tools/device_check.sh", "their-cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=scaled(STAGE_S), check=False,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **SMALLEST, **env})


@pytest.mark.slow
def test_their_stage_dry_run_at_the_smallest_sizes(tmp_path: Path) -> None:
    """``their-cpu`` with 2 persons, 1 a step, 1 round: exit 0, the environment, and one page per precision (fp32
    with TF32, bf16-mixed) whose command line is the sizes given and whose rows are the tiny size's, train and
    predict."""
    r = their_stage(tmp_path / "out")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "their tf32 exit 0" in log and "their bf16-mixed exit 0" in log, log[-2000:]
    assert "torch" in (tmp_path / "out" / "env.txt").read_text()
    for precision in ("tf32", "bf16-mixed"):
        text = (tmp_path / "out" / f"performer-{precision}.md").read_text()
        assert (f"--sizes tiny --populations sample --persons 2 --batch 1 --rounds 1 --device cpu --precision "
                f"{precision} --their-exp as-is`") in text
        rows = [line.strip("|").split(" | ")[:3] for line in text.splitlines() if line.startswith("| tiny")]
        assert [[c.strip() for c in row] for row in rows] == [["tiny", "sample", "train"],
                                                               ["tiny", "sample", "predict"]], text


@pytest.mark.slow
def test_their_stage_fails_without_their_dependencies_or_with_a_bad_size(tmp_path: Path) -> None:
    """performer_pytorch not importable (a module of that name that fails on import, first on the path): exit 2
    naming the dependencies, no bench run; an unknown size, or 0 persons: exit 2 naming the value, no page."""
    broken = tmp_path / "broken" / "performer_pytorch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('performer_pytorch removed for the test')\n")
    r = their_stage(tmp_path / "nodeps", PYTHONPATH=str(broken.parent))
    assert r.returncode == 2, r.stdout[-2000:]
    assert "cannot import torch, performer_pytorch and local_attention" in r.stdout
    assert "bench_performer" not in r.stdout
    for name, (key, value) in {"size": ("THEIR_SIZES", "huge"), "persons": ("THEIR_PERSONS", "0")}.items():
        r = their_stage(tmp_path / name, **{key: value})
        assert r.returncode == 2, (name, r.stdout[-2000:])
        assert f"'{value}'" in r.stdout + r.stderr, (name, r.stdout[-2000:])
        assert not list((tmp_path / name).glob("performer-*.md")), name
