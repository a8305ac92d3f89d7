"""`shardify time`: a timed pass per worker count over one's own dataset, rank 0's share."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import shardify, split_ids


@pytest.mark.timeout(300)
def test_shardify_time_reads_each_worker_count(nomlm_dataset: Path) -> None:
    code, out = shardify("time", nomlm_dataset, "--workers", 0, "--workers", 1, "--batch-size", 64, "--batches", 3)
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+\s", line)]
    assert [row[0] for row in rows] == ["0", "1"], out
    for _, first_s, batches, persons, persons_s, tokens_s in rows:
        # 3 whole batches of 64: the train split holds far more persons than that
        assert int(batches) == 3 and int(persons.replace(",", "")) == 3 * 64, out
        assert float(first_s) > 0 and float(persons_s.replace(",", "")) > 0, out
        # the sample's persons have tens to hundreds of tokens each
        assert 10 < float(tokens_s.replace(",", "")) / float(persons_s.replace(",", "")) < 512, out
    shards, remainder = split_ids(nomlm_dataset, "train")
    assert sum(map(len, shards)) + len(remainder) > 3 * 64


def test_shardify_time_names_a_missing_split(nomlm_dataset: Path) -> None:
    code, out = shardify("time", nomlm_dataset, "--split", "test")
    assert code == 2 and "no split 'test'" in out and len(out.strip().splitlines()) == 1, out
