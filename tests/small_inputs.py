"""Small hand-made converter inputs (an N-person parquet file, h5 rows, a 10-token vocabulary), the check that a
refusal is one line, and `shardify` run with a hook in the converter (what the converter's tests share)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from helpers import shard_ids

from lifeseq_shards.store.remote import read_manifest

SMALL_VOCAB = ("TOKEN,CATEGORY,ID\n[PAD],G,0\n[CLS],G,1\n[SEP],G,2\n[MASK],G,3\n[UNK],G,4\n"
               "a,E,5\nm,B,6\ny,B,7\ng,B,8\no,B,9\n")
BG = {"birth_month": "m", "birth_year": "y", "gender": "g", "origin": "o"}
BG_TYPE = pa.struct([(k, pa.string()) for k in BG])
N = 3  # persons of the small inputs, ids 100, 101, 102


def assert_refused(code: int, out: str, *parts: str) -> None:
    """Exit 2, no traceback, and the last line (after any progress bar) the one error line, holding every part."""
    lines = out.strip().splitlines()
    assert code == 2 and "Traceback" not in out and lines[-1].startswith("error: "), out
    assert sum(line.startswith("error: ") for line in lines) == 1, out
    for part in parts:
        assert part in lines[-1], (part, out)


def write_parquet(path: Path, **columns: Any) -> Path:
    """N persons of 5 one-token events each; ``columns`` replace any column (as arrow arrays or python lists)."""
    cols: dict[str, Any] = {
        "RINPERSOON": pa.array(range(100, 100 + N), pa.int64()),
        "background": pa.array([BG] * N, BG_TYPE),
        "sentence": pa.array([[["a"]] * 5] * N, pa.list_(pa.list_(pa.string()))),
        **{c: pa.array([[1, 2, 3, 4, 5]] * N, pa.list_(pa.int64())) for c in ("abspos", "age", "segment")},
    }
    cols.update(columns)
    pq.write_table(pa.table(cols), path)
    return path


def write_h5(path: Path, n: int = 4, width: int = 8, **override: np.ndarray) -> Path:
    """``n`` rows of 3 tokens ([CLS] a [SEP]), ids 100..; ``override`` replaces whole datasets."""
    ids = np.zeros((n, 4, width), dtype=np.int64)
    ids[:, 0, :3] = [1, 5, 2]
    ids[:, 1, 1:3] = 10
    data = {"input_ids": ids, "padding_mask": (np.arange(width) < 3).astype(np.int64)[None].repeat(n, 0),
            "original_sequence": ids[:, 0], "sequence_id": np.arange(100, 100 + n), **override}
    with h5py.File(path, "w") as h:
        for k, v in data.items():
            h[k] = v
    return path


def person_ids(root: Path) -> list[int]:
    return sorted(int(p) for _, e in read_manifest(root).entries() for p in shard_ids(root / e.file))


# Runs `shardify ARGS...` with a hook in the converter: argv[1] is a directory the hook reports into.
HOOKED = """
import os, sys, time
from pathlib import Path
import lifeseq_shards.convert.encode as e
import lifeseq_shards.convert.passes as c

report = Path(sys.argv[1])
{hook}
from lifeseq_shards.cli import main
main(sys.argv[2:])
"""


def hooked(hook: str, report: Path, *args: object) -> subprocess.Popen[bytes]:
    report.mkdir()
    return subprocess.Popen([sys.executable, "-c", HOOKED.format(hook=hook), str(report), *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
