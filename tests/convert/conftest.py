"""The converter's tests' own fixture: the 10-token vocabulary of tests/small_inputs.py as a file."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_inputs import SMALL_VOCAB


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small_vocab") / "vocab.csv"
    path.write_text(SMALL_VOCAB)
    return path
