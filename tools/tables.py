"""What the benchmarks share: their rows written as CSV, one format for every tool."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fieldnames: Sequence[str] | None = None) -> None:
    """``rows`` into ``path`` (its folder made): the columns are ``fieldnames``, else every key in order of first
    appearance; a missing value is written empty and a key outside the columns is left out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(fieldnames) if fieldnames is not None else list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
