"""The reader's multi-process fixtures: the sample converted into 8 and 7 shards, and the 2 x 2 torchrun run that
tests/reader/test_ddp.py and test_ddp_elastic.py both read (module-scoped: each module builds its own)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ddp_harness import SNAPSHOT_AT, TORCHRUN, TORCHRUN_S, WORKERS, launch

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset

# ---------------------------------------------------------------------------------------------------------------
# datasets and shared runs


def _convert(sample: Path, out: Path, shards: int) -> Path:
    """With the vocabulary, so that the manifest has the vocab_size that dynamic masking takes."""
    convert_dataset([str(sample / "encoded_nomlm.h5")], out, str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=shards))
    return out


@pytest.fixture(scope="module")
def ds8(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 train shards of 695 + a 5-person remainder, 8 val shards of 35: divides 2 ranks x 2 workers and 4 x 2."""
    return _convert(sample, tmp_path_factory.mktemp("ds8"), 8)


@pytest.fixture(scope="module")
def ds7(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 train shards, 7 val shards: does not divide 2 ranks x 2 workers."""
    return _convert(sample, tmp_path_factory.mktemp("ds7"), 7)


@pytest.fixture(scope="module")
def torchrun_two(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchrun --standalone, 2 ranks x 2 workers, 2 epochs, a state_dict snapshot after SNAPSHOT_AT batches."""
    out = tmp_path_factory.mktemp("torchrun") / "result.json"
    launch([[*TORCHRUN, "--standalone", "--nproc_per_node=2", "torchrun_reader.py", str(ds8), str(out), "--workers",
             str(WORKERS), "--epochs", "2", "--snapshot-at", str(SNAPSHOT_AT)]], out.parent, TORCHRUN_S)
    return out
