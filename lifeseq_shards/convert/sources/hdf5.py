"""Read the seed's step-5 ``encoded.h5`` (MLM or not) in bounded memory: a few thousand rows per task."""

from __future__ import annotations

from functools import partial

import h5py
import numpy as np

from ...store.format import Block
from .errors import SourceError
from .exact import exact_int64

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
    """(rows, has offline MLM fields, max sequence length); checks that the datasets the converter needs are there,
    numeric, and of the seed's shapes (N, 4, L), (N, L) and (N,) with one N and one L."""
    with _open(path) as f:
        missing = [k for k in REQUIRED if k not in f]
        if missing:
            raise SourceError(f"{path}: missing dataset(s) {', '.join(missing)}")
        mlm_present = [k in f for k in MLM]
        if any(mlm_present) and not all(mlm_present):
            raise SourceError(f"{path}: has some but not all of the MLM datasets {', '.join(MLM)}")
        shape = f["input_ids"].shape
        if len(shape) != 3 or shape[1] != 4:
            raise SourceError(f"{path}: input_ids has shape {shape}, expected (N, 4, L)")
        n, _, width = shape
        expected = {"input_ids": shape, "padding_mask": (n, width), "original_sequence": (n, width),
                    "sequence_id": (n,), "target_tokens": (n, width), "target_pos": (n, width), "target_cls": (n,)}
        for k in (*REQUIRED, *MLM):
            if k not in f:
                continue
            if f[k].shape != expected[k]:
                raise SourceError(f"{path}: {k} has shape {f[k].shape}, expected {expected[k]} "
                                  f"(input_ids is {shape})")
            if f[k].dtype.kind not in "biuf":
                raise SourceError(f"{path}: {k} holds {f[k].dtype}, not numbers")
        if n == 0:
            raise SourceError(f"{path}: no rows")
        return n, all(mlm_present), width


def h5_tasks(path: str) -> list[tuple[str, int, int]]:
    n, _, _ = h5_info(path)
    return [(path, s, min(s + ROWS_PER_TASK, n)) for s in range(0, n, ROWS_PER_TASK)]


def max_targets(width: int) -> int:
    """The seed keeps floor(0.3 * max_len) targets, then pads with -1."""
    return int(np.floor(0.3 * width))


def _row_of(path: str, start: int, per_row: int, i: int) -> str:
    """The file row of flat position ``i`` of rows [start, ...) of a dataset with ``per_row`` values a row."""
    return f"{path}: row {start + i // per_row}"


def _check_vocab(path: str, start: int, cols: dict[str, np.ndarray], vocab_size: int) -> None:
    """Every token id (unmasked, masked, true ids of the targets) in [0, vocab_size): the manifest records that size
    and the masker and the model's embedding take it as the bound, so an id beyond it would fail (or index out of
    range on a GPU) in training, not here."""
    for name, dataset, count in (("tokens", "original_sequence", "length"), ("masked_tokens", "input_ids", "length"),
                                 ("target_tokens", "target_tokens", "n_targets")):
        if name not in cols:
            continue
        bad = np.flatnonzero((cols[name] < 0) | (cols[name] >= vocab_size))
        if bad.size:
            r = int(np.searchsorted(np.cumsum(cols[count]), bad[0], "right"))
            raise SourceError(f"{path}: row {start + r} (person {cols['person_id'][r]}): {dataset} holds token id "
                              f"{cols[name][bad[0]]}, outside the vocabulary of {vocab_size} (--vocab)")


# One function, over 60 lines: each check names the file and row of the HDF5 slice it has just read, in the order
# the seed wrote the columns; split up, every helper would need the slice, the file and the row offset again.
def encode_h5_task(task: tuple[str, int, int], vocab_size: int | None = None) -> Block:
    """Rows [start, stop) as an int64 Block: unpadded sequences and, for the MLM file, its offline masks; with
    ``vocab_size`` (from --vocab) every token id is checked against it."""
    path, start, stop = task
    try:
        with _open(path) as f:
            raw = {k: f[k][start:stop] for k in (*REQUIRED, *MLM) if k in f}
    except SourceError:
        raise
    except (OSError, KeyError) as e:
        raise SourceError(f"{path}: rows {start}-{stop} unreadable ({e})") from None
    data = {k: exact_int64(a, k, partial(_row_of, path, start, a.size // len(a))) for k, a in raw.items()}
    ids, pad, orig, pid = (data[k] for k in REQUIRED)
    mlm = {k: data[k] for k in MLM} if all(k in data for k in MLM) else None
    n, _, width = ids.shape
    lengths = pad.sum(axis=1)
    real = np.arange(width)[None, :] < lengths[:, None]
    bad = np.nonzero((pad != real.astype(pad.dtype)).any(axis=1))[0]
    if len(bad):
        raise SourceError(f"{path}: row {start + bad[0]}: padding_mask is not a prefix of ones")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:  # a person of no tokens: the reader has nothing to train on, and verify refuses it
        raise SourceError(f"{path}: row {start + empty[0]} (person {pid[empty[0]]}): no tokens (padding_mask all 0)")
    cols = {
        "person_id": pid,
        "row": start + np.arange(n),  # for errors that name the file row (a duplicated id); not stored
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
        if vocab_size is not None:
            _check_vocab(path, start, cols, vocab_size)
        return Block(cols)
    t = max_targets(width)
    tpos, ttok = mlm["target_pos"], mlm["target_tokens"]
    used = ~((tpos[:, :t] == width - 1) & (ttok[:, :t] == 0))
    n_targets = used.sum(axis=1)
    prefix = np.arange(t)[None, :] < n_targets[:, None]
    tail_ok = (tpos[:, t:] == -1).all(axis=1) & (ttok[:, t:] == -1).all(axis=1)
    bad = np.nonzero((used != prefix).any(axis=1) | ~tail_ok)[0]
    if len(bad):
        raise SourceError(f"{path}: row {start + bad[0]}: targets are not the seed's form "
                          f"({t} targets filled from the front, then -1)")
    owner = np.repeat(np.arange(n), n_targets)
    target_pos = tpos[:, :t][prefix]
    outside = np.flatnonzero((target_pos < 0) | (target_pos >= lengths[owner]))
    if outside.size:  # a label for a padding position: verify refuses it, and no loss can use it
        r = owner[outside[0]]
        raise SourceError(f"{path}: row {start + r} (person {pid[r]}): target_pos {target_pos[outside[0]]} is not "
                          f"a position of its {lengths[r]} tokens")
    cols.update(
        n_targets=n_targets.astype(np.int64),
        target_cls=mlm["target_cls"].astype(np.int64),
        masked_tokens=ids[:, 0][real],
        target_pos=target_pos,
        target_tokens=ttok[:, :t][prefix],
    )
    if vocab_size is not None:
        _check_vocab(path, start, cols, vocab_size)
    return Block(cols)
