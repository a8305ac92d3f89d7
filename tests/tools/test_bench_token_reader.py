"""The token-budget reader bench, quick: rank 0 of a 2-rank arrangement reads its whole epoch both ways, and the rates
it reports are those of the persons each mode hands that rank."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, repo_first, scaled

from lifeseq_shards.reader import ShardedDataset, World
from tools import bench_token_reader

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]


def test_the_rate_counts_the_persons_of_rank_0s_epoch(nomlm_dataset: Path) -> None:
    for budget in (None, 8000):
        rate, persons = bench_token_reader.epoch_rate(bench_token_reader.warm_loader(nomlm_dataset, 2, 0, 50, budget),
                                                      1)
        ds = ShardedDataset(nomlm_dataset, world=World(0, 2), batch_size=50, tokens_per_batch=budget)
        ds.set_epoch(1)
        assert persons == sum(len(b["person_id"]) for b in ds) and rate > 0


def test_the_bench_writes_its_table(nomlm_dataset: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "tools.bench_token_reader", "--out", str(tmp_path), "--data",
                        str(nomlm_dataset), "--ranks", "2", "--workers", "0", "--rounds", "1", "--batch", "24"],
                       cwd=REPO, env=repo_first(os.environ), capture_output=True, text=True, timeout=scaled(240))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "token-reader.csv").open()))
    assert [(row["ranks"], row["workers"]) for row in rows] == [("2", "0")]
    assert float(rows[0]["token_over_persons"]) > 0 and "| 2 | 0 |" in r.stdout
