"""The embedding tests' data: a small converted dataset and one finished embedding output of it (module-scoped:
each module builds its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from embed_helpers import embed_in_process

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 train shards of 124 + a remainder of 2, 5 val shards of 10: 11 shards, which 2 ranks do not divide."""
    raw, out = tmp_path_factory.mktemp("raw"), tmp_path_factory.mktemp("ds")
    synth_population(raw, 700, seed=3, progress=False)
    convert_dataset([str(raw / "sequences.parquet")], out, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=5, num_val=50, block_persons=16))
    return out


@pytest.fixture(scope="module")
def done(ds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("done") / "emb"
    embed_in_process(ds, out)
    return out
