"""``pandas.read_csv`` as their loop uses it (the number of rows of the vocabulary CSV), without pandas."""

from __future__ import annotations

import csv


def read_csv(path: str) -> list[list[str]]:
    """The data rows of a CSV file (its header left out)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))[1:]


# below pyarrow's minimum, so that pyarrow (the embeddings' parquet) treats pandas as absent, as it is
__version__ = "0.0"
