"""Where the tests find the researchers' sample: where CI and the development machines lay it (../shared beside the
clone; ``LIFESEQ_SHARED`` names another folder, or a missing one to test as a fresh clone would), else the
byte-identical copy the repository carries, so that a fresh clone passes its tests with nothing beside it
(test_sample.py checks the two are the same)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_SAMPLE = Path(os.environ.get("LIFESEQ_SHARED", REPO.parent / "shared")) / "data" / "lifeseq-sample"
CARRIED_SAMPLE = REPO / "tests" / "data" / "lifeseq-sample"
SAMPLE_FILES = ("README.md", "encoded_mlm.h5", "encoded_nomlm.h5", "sequences.parquet", "vocab.csv")
SAMPLE = SHARED_SAMPLE if (SHARED_SAMPLE / "encoded_mlm.h5").exists() else CARRIED_SAMPLE
