"""The tools that read the researchers' sample default to the copy this repository carries (tests/data/lifeseq-sample),
so that they run in a fresh clone without a shared folder beside it; ``--sample`` names another."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REPO

from tools import bench_static, seed_pretrain_check


@pytest.mark.parametrize(("default", "reads"), [
    (seed_pretrain_check.SAMPLE, ("encoded_mlm.h5", "encoded_nomlm.h5", "vocab.csv")),
    (bench_static.SAMPLE, ("encoded_nomlm.h5", "vocab.csv")),
], ids=["seed_pretrain_check", "bench_static"])
def test_the_default_sample_is_the_carried_copy(default: Path, reads: tuple[str, ...]) -> None:
    assert default == REPO / "tests" / "data" / "lifeseq-sample"
    assert all((default / name).is_file() for name in reads), sorted(p.name for p in default.iterdir())
