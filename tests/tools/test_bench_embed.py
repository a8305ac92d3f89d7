"""The embedding benchmark, quick: both contenders embed the same persons to the same numbers, and it prints ratios."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest

from lifeseq_shards.embed.check import merge_embeddings
from tools import bench_embed


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ours_and_the_seeds_pattern_embed_the_same_persons_alike(tmp_path: Path) -> None:
    root = bench_embed.dataset(tmp_path, 3000, seq=24, shard_persons=256)
    r = bench_embed.measure(root, tmp_path, seq=24)
    print(json.dumps({k: r[k] for k in ("ours", "theirs")}))
    merge_embeddings(r["out"]["ours"], tmp_path / "ours.parquet", progress=False)
    ours = pq.read_table(tmp_path / "ours.parquet")
    with h5py.File(r["out"]["theirs"]) as f:
        order = np.argsort(f["sequence_id"][:])
        ids, cls, mean = f["sequence_id"][:][order], f["cls_emb"][:][order], f["mean_emb"][:][order]
    assert r["ours"]["persons"] == r["theirs"]["persons"] == len(ids) == ours.num_rows
    assert ours.column("person_id").to_numpy().tolist() == ids.tolist()
    np.testing.assert_allclose(np.stack(ours.column("cls").to_numpy(zero_copy_only=False)), cls, atol=1e-5)
    np.testing.assert_allclose(np.stack(ours.column("mean").to_numpy(zero_copy_only=False)), mean, atol=1e-5)
