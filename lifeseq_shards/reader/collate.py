"""Persons of a decoded block -> one batch, in narrow dtypes: packed into one buffer of real tokens (which the
device pads) or padded here. Everything a batch's shape depends on is in a small frozen :class:`BatchSpec`, so the
functions run without a dataset (tools/bench_stamps.py times them alone)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import compat
from ..format import COUNT_OF, RAGGED, SCALAR, Block, Field, expand_runs, ragged_counts, token_schema


@dataclass(frozen=True)
class BatchSpec:
    """How a dataset cuts and collates its batches. ``source`` names the dataset in error messages;
    ``offline_mlm``: its offline MLM targets point into the whole sequence, so it is padded to ``pad_to``, never
    cropped."""

    schema: Sequence[Field]
    batch_size: int
    drop_last: bool = False
    packed: bool = False
    pad_multiple: int = 8
    pad_to: int | None = None
    offline_mlm: bool = False
    source: str = ""


def collate(block: Block, spec: BatchSpec, index: np.ndarray | None = None) -> dict[str, Any]:
    """Persons ``index`` of ``block`` (all of it when None) as a batch: packed when ``spec.packed``, else padded."""
    if spec.packed:
        return collate_packed(block, spec, np.arange(block.n) if index is None else index)
    return collate_padded(block if index is None else block.take(index, spec.schema), spec)


def collate_packed(block: Block, spec: BatchSpec, index: np.ndarray) -> dict[str, Any]:
    """The whole batch in ONE uint8 array: each field's values (ragged ones concatenated: only real tokens cross
    the bus) 8-byte aligned, described by ``fields`` = ((name, dtype, offset, count), ...), plus the padded widths
    as ints. Values are gathered straight from the window's block into the buffer (one copy). A numpy array, not a
    tensor, on purpose: in a DataLoader worker it is copied into the worker's ring (or pickled through its pipe)
    where a tensor would go through a fresh shared-memory segment, which costs more than making the batch.
    :class:`ShardedLoader` turns it into a (pinned) tensor; ``lifeseq_shards.device.padded_fields`` into named, padded
    tensors on the device."""
    schema = spec.schema
    c = block.columns
    flat = {k: block.gather_index(index, k) for k in ragged_counts(schema)}
    sources = [(f, index if f.kind == SCALAR else flat[COUNT_OF[f.kind]]) for f in schema]
    fields, offset = [], 0
    for f, idx in sources:
        dtype = c[f.name].dtype
        fields.append((f.name if f.name != "length" else "lengths", dtype.str, offset, len(idx)))
        offset += -(-len(idx) * dtype.itemsize // 8) * 8
    buf = np.empty(offset, dtype=np.uint8)
    columns = {}
    for (name, dtype, off, count), (f, idx) in zip(fields, sources, strict=True):
        end = off + count * np.dtype(dtype).itemsize
        buf[end : end + (-end) % 8] = 0  # the alignment gap: the same persons always pack into the same bytes
        # mode="wrap": the indices are in range by construction, and "raise" would copy through a buffer
        columns[name] = np.take(c[f.name], idx, out=buf[off:end].view(dtype), mode="wrap")
    out: dict[str, Any] = {
        "packed": buf,
        "fields": tuple(fields),
        "width": _padded_width(columns["lengths"], spec.pad_multiple),
    }
    if "n_targets" in columns:
        out["targets_width"] = int(columns["n_targets"].max(initial=0))
    return out


def collate_padded(block: Block, spec: BatchSpec) -> dict[str, Any]:
    """Pad the ragged fields to the batch's longest (a multiple of pad_multiple) or to pad_to, keep narrow dtypes;
    stamps stored once per run are repeated over their tokens first."""
    schema = spec.schema
    c = expand_runs(block, schema).columns
    lengths = c["length"].astype(np.int64)
    if spec.pad_to is not None:
        width = spec.pad_to
        keep = np.minimum(lengths, width)
        if spec.offline_mlm and (lengths > width).any():
            i = int(np.argmax(lengths > width))
            raise ValueError(f"{spec.source}: person {int(c['person_id'][i])} has {int(lengths[i])} tokens, more "
                             f"than pad_to={width}: cropping would lose tokens that its offline MLM targets point "
                             "to; set pad_to to at least the longest person (the seed's 512), or leave it unset")
    else:
        width = _padded_width(lengths, spec.pad_multiple)
        keep = lengths
    out: dict[str, Any] = {"person_id": torch.from_numpy(np.ascontiguousarray(c["person_id"])),
                           "lengths": torch.from_numpy(keep.astype(np.int32))}
    masks = {"length": _prefix_mask(keep, width)}
    src_masks = {"length": _prefix_mask(lengths, int(lengths.max(initial=0)))} if spec.pad_to is not None else None
    if "n_targets" in c:
        nt = c["n_targets"].astype(np.int64)
        masks["n_targets"] = _prefix_mask(nt, int(nt.max(initial=0)))
    for f in token_schema(schema):
        if f.name in ("person_id", "length"):
            continue
        col = c[f.name]
        if f.kind == SCALAR:
            out[f.name] = compat.to_tensor(np.ascontiguousarray(col))
            continue
        m = masks[COUNT_OF[f.kind]]
        arr = np.zeros(m.shape, dtype=col.dtype)
        if f.kind == RAGGED and src_masks is not None:  # crop: drop values past pad_to
            full = np.zeros(src_masks["length"].shape, dtype=col.dtype)
            full[src_masks["length"]] = col
            arr[:, : min(width, full.shape[1])] = full[:, :width]
        else:
            arr[m] = col
        out[f.name] = compat.to_tensor(arr)
    views = tuple(f.name for f in schema if f.name in out and compat.is_view(f.dtype))
    if views:  # torch < 2.3: the device reads them back as unsigned (compat.widen_views)
        out[compat.SIGNED_VIEWS] = views
    return out


def _padded_width(lengths: np.ndarray, multiple: int) -> int:
    """The batch's longest sequence rounded up to a multiple of ``multiple`` (at least one slot)."""
    return int(-(-max(1, int(lengths.max(initial=1))) // multiple) * multiple)


def _prefix_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] < lengths[:, None]
