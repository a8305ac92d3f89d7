"""Host -> device transfer of the narrow host batch, and its widening into the seed model's batch on the device.

Narrow dtypes (uint16 tokens, int16 abspos, uint8 age/segment) cross the bus, the stamps once per run of tokens that
share them (format 2); the repetition over tokens, the int64 widening, the padding mask and the MLM targets are built
on the device: ~3 bytes a real token cross the bus instead of the seed batch's 48 a padded slot.
torch >= 2.3 copies and casts uint16 on CPU and CUDA (copy_ dispatches the "barebones" unsigned types), so uint16
travels as is: no int16 reinterpretation is needed.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch

from lifeseq_shards.format import RUN_LENGTH, STAMPS
from lifeseq_shards.masking import DEFAULT_RATIO, DynamicMasker, fill_target_slots

OFFLINE_MLM_FIELDS = ("masked_tokens", "target_pos", "target_tokens", "n_targets", "target_cls")


def to_device(batch: dict[str, Any], device: torch.device | str, non_blocking: bool = True) -> dict[str, Any]:
    """Every tensor moved as is (same dtype), asynchronously when the source is pinned (the DataLoader's
    pin_memory); what is not a tensor (a packed batch's layout and widths) stays on the host, where the shapes are
    decided."""
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        out[name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
    return out


def split_packed(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Named flat tensors out of a packed batch's single buffer: views, no copy, no sync."""
    buf = batch["packed"]
    buf = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
    out = {}
    for name, dtype, offset, count in batch["fields"]:
        dt = _torch_dtype(dtype)
        out[name] = buf[offset : offset + count * dt.itemsize].view(dt)
    out["lengths"] = out["lengths"].int()
    return out


@functools.cache
def _torch_dtype(numpy_dtype: str) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=numpy_dtype)).dtype


def unpack(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A packed batch (``ShardedDataset(packed=True)``: one buffer, ragged fields concatenated, stamps once per
    run) as named tensors padded to the batch width, built where the buffer lives.

    The widths come from the host as ints, so the padded shapes are known without reading a device value: the
    padding is one gather per field, no boolean indexing (which would sync to learn its size).
    """
    if "packed" not in batch:
        return batch
    out = split_packed(batch)
    if RUN_LENGTH in out:  # stamps once per run (format 2): repeat them over their tokens, output size known
        reps = out.pop(RUN_LENGTH).long()
        del out["n_runs"]
        run_of = torch.repeat_interleave(torch.arange(reps.shape[0], device=reps.device), reps,
                                         output_size=out["tokens"].shape[0])
        for name in STAMPS:
            out[name] = out[name][run_of]
    counts = {"width": out["lengths"]}
    if "targets_width" in batch:
        counts["targets_width"] = out["n_targets"]
    for width_key, count in counts.items():
        index, valid = _ragged_index(count.long(), int(batch[width_key]))
        for name in RAGGED_FIELDS if width_key == "width" else TARGET_FIELDS:
            if name in out:
                flat = out[name]
                gathered = flat[index.clamp(max=max(flat.shape[0] - 1, 0))] if flat.shape[0] else flat.new_zeros(
                    index.shape)
                out[name] = _zero_where_invalid(gathered, valid)
    return out


# torch 2.11 has no CPU `where` for uint16 (2.13 has); a signed view of the same width has the same bits.
_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _zero_where_invalid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`values` where `valid`, else 0, in the same dtype."""
    view = values.view(_SIGNED_VIEW.get(values.dtype, values.dtype))
    return torch.where(valid, view, torch.zeros((), dtype=view.dtype, device=view.device)).view(values.dtype)


RAGGED_FIELDS = ("tokens", "abspos", "age", "segment", "masked_tokens")
TARGET_FIELDS = ("target_pos", "target_tokens")


def _ragged_index(counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) flat positions of each row's values in the concatenation, and which of them are real."""
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(width, device=counts.device)
    return starts[:, None] + col[None, :], col[None, :] < counts[:, None]


def seed_batch(
    batch: dict[str, torch.Tensor], masker: DynamicMasker | None = None, *, epoch: int = 0
) -> dict[str, torch.Tensor]:
    """The seed model's batch (docs/masking.md), built where ``batch`` lives, without a host sync.

    With ``masker`` the masks are drawn now (dynamic masking, ``epoch`` picks the draw); else the offline MLM fields
    are used when present (padded to max(floor(0.3 L), their T) slots, so no target is ever dropped); else there are
    no targets. A packed batch is padded first (:func:`unpack`).
    """
    batch = unpack(batch)
    tokens = batch["tokens"].long()
    stamps = [batch[k].long() for k in ("abspos", "age", "segment")]
    lengths = batch["lengths"].long()
    L = tokens.shape[1]
    out = {
        "person_id": batch["person_id"],
        "lengths": batch["lengths"],
        "padding_mask": (torch.arange(L, device=tokens.device) < lengths[:, None]).long(),
    }
    shown = tokens
    if masker is not None:
        m = masker(tokens, *stamps, lengths, batch["person_id"], epoch)
        shown, tokens, stamps = m["masked_tokens"], m["original"], [m["abspos"], m["age"], m["segment"]]
        out.update(target_pos=m["target_pos"], target_tokens=m["target_tokens"], target_cls=m["target_cls"])
    elif all(k in batch for k in OFFLINE_MLM_FIELDS):
        shown = batch["masked_tokens"].long()
        pos, tok = batch["target_pos"].long(), batch["target_tokens"].long()
        slots = max(math.floor(DEFAULT_RATIO * L), pos.shape[1])
        target_pos, target_tokens = fill_target_slots(pos, tok, batch["n_targets"].long(), L, slots)
        out.update(target_pos=target_pos, target_tokens=target_tokens, target_cls=batch["target_cls"].long())
    out["input_ids"] = torch.stack([shown, *stamps], 1)
    out["original_sequence"] = tokens
    return out


@contextlib.contextmanager
def host_sync_guard() -> Iterator[None]:
    """Make host<->device syncs raise inside the block: CUDA's sync debug mode "error" when CUDA is there, and, on
    every device, the Python-level ways to pull a value to the host (item, tolist, cpu, numpy, bool/int/float/index).

    For tests and smoke runs of the per-step path; not meant to stay on in training.
    """

    def forbidden(*_args, **_kwargs):
        raise RuntimeError("host sync inside a no-sync section")

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch.Tensor, name, forbidden))
        if torch.cuda.is_available():
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        yield
