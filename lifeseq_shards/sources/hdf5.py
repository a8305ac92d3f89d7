"""Read the seed's step-5 ``encoded.h5`` (MLM or not) in bounded memory: a few thousand rows per task."""

from __future__ import annotations

import h5py
import numpy as np

from ..format import Block
from .errors import SourceError

ROWS_PER_TASK = 2048
REQUIRED = ("input_ids", "padding_mask", "original_sequence", "sequence_id")
MLM = ("target_tokens", "target_pos", "target_cls")


def _open(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except OSError as e:
        raise SourceError(f"{path}: not a readable HDF5 file ({e})") from None


def h5_info(path: str) -> tuple[int, bool, int]:
    """(rows, has offline MLM fields, max sequence length); checks the datasets the converter needs."""
    with _open(path) as f:
        missing = [k for k in REQUIRED if k not in f]
        if missing:
            raise SourceError(f"{path}: missing dataset(s) {', '.join(missing)}")
        n, four, width = f["input_ids"].shape
        if four != 4:
            raise SourceError(f"{path}: input_ids has shape {f['input_ids'].shape}, expected (N, 4, L)")
        mlm_present = [k in f for k in MLM]
        if any(mlm_present) and not all(mlm_present):
            raise SourceError(f"{path}: has some but not all of the MLM datasets {', '.join(MLM)}")
        if n == 0:
            raise SourceError(f"{path}: no rows")
        return n, all(mlm_present), width


def h5_tasks(path: str) -> list[tuple[str, int, int]]:
    n, _, _ = h5_info(path)
    return [(path, s, min(s + ROWS_PER_TASK, n)) for s in range(0, n, ROWS_PER_TASK)]


def target_slots(width: int) -> int:
    """The seed keeps floor(0.3 * max_len) target slots, then pads with -1."""
    return int(np.floor(0.3 * width))


def encode_h5_task(task: tuple[str, int, int]) -> Block:
    """Rows [start, stop) as an int64 Block: unpadded sequences and, for the MLM file, its offline masks."""
    path, start, stop = task
    try:
        with _open(path) as f:
            ids = f["input_ids"][start:stop]
            pad = f["padding_mask"][start:stop]
            orig = f["original_sequence"][start:stop]
            pid = f["sequence_id"][start:stop]
            mlm = {k: f[k][start:stop] for k in MLM} if all(k in f for k in MLM) else None
    except SourceError:
        raise
    except (OSError, KeyError) as e:
        raise SourceError(f"{path}: rows {start}-{stop} unreadable ({e})") from None
    n, _, width = ids.shape
    lengths = pad.sum(axis=1)
    real = np.arange(width)[None, :] < lengths[:, None]
    bad = np.nonzero((pad != real.astype(pad.dtype)).any(axis=1))[0]
    if len(bad):
        raise SourceError(f"{path}: row {start + bad[0]}: padding_mask is not a prefix of ones")
    cols = {
        "person_id": pid.astype(np.int64),
        "length": lengths.astype(np.int64),
        "tokens": orig[real],
        "abspos": ids[:, 1][real],
        "age": ids[:, 2][real],
        "segment": ids[:, 3][real],
    }
    if mlm is None:
        differ = np.nonzero(((ids[:, 0] != orig) & real).any(axis=1))[0]
        if len(differ):
            raise SourceError(f"{path}: row {start + differ[0]}: input_ids differs from original_sequence "
                              "but the file has no MLM targets")
        return Block(cols)
    t = target_slots(width)
    tpos, ttok = mlm["target_pos"], mlm["target_tokens"]
    used = ~((tpos[:, :t] == width - 1) & (ttok[:, :t] == 0))
    n_targets = used.sum(axis=1)
    prefix = np.arange(t)[None, :] < n_targets[:, None]
    tail_ok = (tpos[:, t:] == -1).all(axis=1) & (ttok[:, t:] == -1).all(axis=1)
    bad = np.nonzero((used != prefix).any(axis=1) | ~tail_ok)[0]
    if len(bad):
        raise SourceError(f"{path}: row {start + bad[0]}: target slots are not the seed's layout "
                          f"({t} slots filled from the front, then -1)")
    cols.update(
        n_targets=n_targets.astype(np.int64),
        target_cls=mlm["target_cls"].astype(np.int64),
        masked_tokens=ids[:, 0][real],
        target_pos=tpos[:, :t][prefix],
        target_tokens=ttok[:, :t][prefix],
    )
    return Block(cols)
