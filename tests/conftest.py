"""Shared fixtures: the researchers' sample files (../shared, as in CI) and small converted datasets."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SMALL_SHARDS, SeedRows
from hypothesis import settings

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset

# Hypothesis's per-example deadline (200 ms) measures the machine, not the code: on a loaded 2-core CI runner an
# unchanged plan function missed it. The properties and example counts stay as written.
settings.register_profile("lifeseq", deadline=None)
settings.load_profile("lifeseq")

SAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lifeseq-sample"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``cuda`` is skipped where there is no CUDA device (pyproject's marker says so)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")


@pytest.fixture(scope="session")
def sample() -> Path:
    if not (SAMPLE / "encoded_mlm.h5").exists():
        pytest.fail(f"{SAMPLE}: the shared sample is missing (CI lays ../shared beside the clone)")
    return SAMPLE


@pytest.fixture(scope="session")
def nomlm_rows(sample: Path) -> SeedRows:
    """The seed's rows of encoded_nomlm.h5, the reference the converted persons are compared with."""
    return SeedRows.from_h5(sample / "encoded_nomlm.h5")


@pytest.fixture(scope="session")
def mlm_rows(sample: Path) -> SeedRows:
    return SeedRows.from_h5(sample / "encoded_mlm.h5")


@pytest.fixture(scope="session")
def mlm_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_mlm.h5 converted: 48 train shards of 115 persons + a 45-person remainder, 2 val shards (small shards,
    ``SMALL_SHARDS``, so that the partition tests have many shards to deal between ranks and workers)."""
    out = tmp_path_factory.mktemp("mlm")
    convert_dataset([str(sample / "encoded_mlm.h5")], out, opts=ConvertOptions(progress=False, **SMALL_SHARDS))
    return out


@pytest.fixture(scope="session")
def nomlm_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nomlm")
    convert_dataset([str(sample / "encoded_nomlm.h5")], out,
                    opts=ConvertOptions(progress=False, with_all=True, **SMALL_SHARDS))
    return out


def _with_vocab(sample: Path, out: Path, shards: int) -> Path:
    """encoded_nomlm.h5 in ``shards`` train shards, converted with --vocab: the manifest knows the vocabulary size."""
    convert_dataset([str(sample / "encoded_nomlm.h5")], out, str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=shards))
    return out


@pytest.fixture(scope="module")
def vocab_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_vocab(sample, tmp_path_factory.mktemp("vocab"), 4)


@pytest.fixture(scope="module")
def vocab_ds8(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_vocab(sample, tmp_path_factory.mktemp("ds8"), 8)
