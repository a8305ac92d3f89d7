"""Persons of a decoded block -> one batch, in narrow dtypes: packed into one buffer of real tokens (which the
device pads) or padded here. Everything a batch's shape depends on is in a small frozen :class:`BatchSpec`, so the
functions run without a dataset (a benchmark can time them alone)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import compat
from ..device.batch import Column, PackedBatch, PaddedBatch, batch_name
from ..store.format import COUNT_OF, RAGGED, SCALAR, Block, Field, expand_runs, ragged_counts, token_schema


@dataclass(frozen=True)
class BatchSpec:
    """How a dataset collates a batch of persons (how many go into one is the plan's ``batch_size``).
    ``source`` names the dataset in error messages; ``offline_mlm``: its offline MLM targets point into the whole
    sequence, so it is padded to ``pad_to``, never cropped."""

    schema: Sequence[Field]
    packed: bool = False
    pad_multiple: int = 8
    pad_to: int | None = None
    offline_mlm: bool = False
    source: str = ""
    # the packed batches' columns by the block's dtypes: one tuple for all of a dataset's batches
    _columns: dict[tuple[np.dtype, ...], tuple[Column, ...]] = field(default_factory=dict, init=False, repr=False,
                                                                    compare=False)


def collate(block: Block, spec: BatchSpec, index: np.ndarray | None = None) -> PackedBatch | PaddedBatch:
    """Persons ``index`` of ``block`` (all of it when None) as a batch: packed when ``spec.packed``, else padded."""
    if spec.packed:
        return collate_packed(block, spec, np.arange(block.n) if index is None else index)
    return collate_padded(block if index is None else block.take(index, spec.schema), spec)


def collate_packed(block: Block, spec: BatchSpec, index: np.ndarray) -> PackedBatch:
    """The whole batch in ONE uint8 array (a :class:`~lifeseq_shards.device.batch.PackedBatch`): each field's values
    (ragged ones concatenated: only real tokens cross the bus) 8-byte aligned, laid out by its spans, plus the
    padded widths as ints. Values are gathered straight from the window's block into the buffer (one copy). A
    numpy array, not a tensor, on purpose: in a DataLoader worker it is copied into the worker's ring (or pickled
    through its pipe) where a tensor would go through a fresh shared-memory segment, which costs more than making
    the batch. :class:`ShardedLoader` turns it into a (pinned) tensor; ``lifeseq_shards.device.build.padded_fields``
    into named, padded tensors on the device."""
    schema = spec.schema
    c = block.columns
    flat = {k: block.gather_index(index, k) for k in ragged_counts(schema)}
    sources = [(f, index if f.kind == SCALAR else flat[COUNT_OF[f.kind]]) for f in schema]
    dtypes = tuple(c[f.name].dtype for f in schema)
    columns = spec._columns.get(dtypes)
    if columns is None:
        columns = spec._columns[dtypes] = tuple(Column(batch_name(f.name), d.str, f.kind)
                                                for f, d in zip(schema, dtypes, strict=True))
    offsets, counts, offset = [], [], 0
    for (_, idx), dtype in zip(sources, dtypes, strict=True):
        offsets.append(offset)
        counts.append(len(idx))
        offset += -(-len(idx) * dtype.itemsize // 8) * 8
    buf = np.empty(offset, dtype=np.uint8)
    values = {}
    for (f, idx), dtype, col, off in zip(sources, dtypes, columns, offsets, strict=True):
        end = off + len(idx) * dtype.itemsize
        buf[end : end + (-end) % 8] = 0  # the alignment gap: the same persons always pack into the same bytes
        # mode="wrap": the indices are in range by construction, and "raise" would copy through a buffer
        values[col.name] = np.take(c[f.name], idx, out=buf[off:end].view(dtype), mode="wrap")
    targets_width = int(values["n_targets"].max(initial=0)) if "n_targets" in values else None
    return PackedBatch(buf, columns, tuple(offsets), tuple(counts), _padded_width(values["lengths"], spec.pad_multiple),
                       targets_width)


def collate_padded(block: Block, spec: BatchSpec) -> PaddedBatch:
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
    ids, kept = np.ascontiguousarray(c["person_id"]), keep.astype(np.int32)
    out = {"person_id": torch.from_numpy(ids), "lengths": torch.from_numpy(kept)}
    columns = [Column("person_id", ids.dtype.str, SCALAR), Column("lengths", kept.dtype.str, SCALAR)]
    masks = {"length": _prefix_mask(keep, width)}
    src_masks = {"length": _prefix_mask(lengths, int(lengths.max(initial=0)))} if spec.pad_to is not None else None
    if "n_targets" in c:
        nt = c["n_targets"].astype(np.int64)
        masks["n_targets"] = _prefix_mask(nt, int(nt.max(initial=0)))
    for f in token_schema(schema):
        if f.name in ("person_id", "length"):
            continue
        col = c[f.name]
        columns.append(Column(f.name, col.dtype.str, f.kind))
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
    return PaddedBatch(out, tuple(columns))


def _padded_width(lengths: np.ndarray, multiple: int) -> int:
    """The batch's longest sequence rounded up to a multiple of ``multiple`` (at least one slot)."""
    return int(-(-max(1, int(lengths.max(initial=1))) // multiple) * multiple)


def _prefix_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] < lengths[:, None]
