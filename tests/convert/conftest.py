"""The converter's tests' own fixtures: the 10-token vocabulary of tests/small_inputs.py as a file; 700 synthetic
persons."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_inputs import SMALL_VOCAB

from lifeseq_shards.convert.sources.synth import synth_population


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small_vocab") / "vocab.csv"
    path.write_text(SMALL_VOCAB)
    return path


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """700 synthetic persons: a dataset of about 360 KiB (5 train shards of about 65 KiB)."""
    out = tmp_path_factory.mktemp("raw")
    synth_population(out, 700, seed=3, progress=False)
    return out
