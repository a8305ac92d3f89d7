"""Host -> device transfer of the narrow host batch, and its widening into the model's batch on the device.

Narrow dtypes (uint16 tokens, int16 abspos, uint8 age/segment) cross the bus, the stamps once per run of tokens that
share them (format 2); the repetition over tokens, the int64 widening, the padding mask and the MLM targets are built
on the device, so the bus carries a few bytes a real token instead of the padded int64 batch (docs/results/reader.md).
uint16 travels as is: torch copies and casts it on CPU and CUDA (before torch 2.3, which has no uint16 tensors, as its
int16 view, read back as unsigned here: lifeseq_shards.compat).

The model's batch is the one the researchers' (seed) code trains on. Two layouts leave :func:`model_batch`: the
seed's padded (B, L) batch, and the packed one (only the real tokens, for the encoder's padding-free path). Both are
drawn by the same masking code on the same padded intermediate, so a person gets the same masks in both.
:class:`lifeseq_shards.device.prefetch.DevicePrefetcher` builds the next batch while the current step runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch

from lifeseq_shards import compat
from lifeseq_shards.device.batch import (
    NO_CLS,
    OFFLINE_MLM_FIELDS,
    HostBatch,
    ModelBatch,
    PackedBatch,
    PackedModelBatch,
    PaddedBatch,
    PaddedModelBatch,
    StaticModelBatch,
    check_fields,
    widen_unsigned,
)
from lifeseq_shards.device.index import packed_cells, padded_rows, starts
from lifeseq_shards.device.shape import PACKED, PADDED, StaticShape, check_static
from lifeseq_shards.masking import DEFAULT_RATIO, DynamicMasker, Offline, fill_targets
from lifeseq_shards.store.format import RAGGED, RUN_LENGTH, RUNS, STAMPS, TARGETS


def to_device(batch: HostBatch, device: torch.device | str, non_blocking: bool = True) -> HostBatch:
    """The host batch's tensors moved as they are (same dtype), asynchronously when the source is pinned (the
    DataLoader's pin_memory); a packed batch's spans and widths stay on the host, where the shapes are decided."""
    return batch.to(device, non_blocking=non_blocking)


def packed_views(batch: PackedBatch) -> dict[str, torch.Tensor]:
    """Named flat tensors out of a packed batch's single buffer: views, no copy, no sync (stamps still once per
    run; :func:`padded_fields` gives them per token, padded). Before torch 2.3 an unsigned field is read out of its
    signed view, widened where the buffer lives."""
    buf = batch.buffer
    buf = compat.to_tensor(buf) if not isinstance(buf, torch.Tensor) else buf
    out = {}
    for name, dtype, _, offset, count in batch.spans:
        dt = compat.torch_dtype(dtype)
        view = buf[offset : offset + count * dt.itemsize].view(dt)
        out[name] = compat.unsigned(view) if compat.is_view(dtype) else view
    out["lengths"] = out["lengths"].int()
    return out


def padded_fields(batch: HostBatch, width: int | None = None) -> dict[str, torch.Tensor]:
    """The host batch's fields as named tensors, padded, built where the batch lives. A packed batch
    (``ShardedDataset(packed=True)``: one buffer, ragged fields concatenated, stamps once per run) is padded by each
    field's kind: per-token fields to the batch width, or to ``width`` (cropping longer persons, ``lengths``
    clamped: the reader's ``pad_to`` for packed batches), targets to the targets' width, stamps first repeated over
    their run. A padded batch comes as it is, its signed views (torch < 2.3) read back as unsigned.

    The widths come from the host as ints, so the padded shapes are known without reading a device value: the
    padding is one gather per field, no boolean indexing (which would sync to learn its size).
    """
    if isinstance(batch, PaddedBatch):
        return batch.widened()
    out = packed_views(batch)
    kind = {s.name: s.kind for s in batch.spans}
    if RUN_LENGTH in out:  # stamps once per run (format 2): repeat them over their tokens, output size known
        reps = out.pop(RUN_LENGTH).long()
        del out["n_runs"]
        run_of = torch.repeat_interleave(torch.arange(reps.shape[0], device=reps.device), reps,
                                         output_size=out["tokens"].shape[0])
        for name in out:
            if kind[name] == RUNS:
                out[name] = _take(out[name], run_of)
    padded = [(out["lengths"], batch.width if width is None else width, (RAGGED, RUNS))]
    if batch.targets_width is not None:
        padded.append((out["n_targets"], batch.targets_width, (TARGETS,)))
    for count, to_width, kinds in padded:
        index, valid = padded_rows(count.long(), int(to_width))
        for name, flat in out.items():
            if kind[name] in kinds:
                gathered = _take(flat, index.clamp(max=max(flat.shape[0] - 1, 0))) if flat.shape[0] else (
                    flat.new_zeros(index.shape))
                out[name] = _zero_where_invalid(gathered, valid)
    if width is not None:
        out["lengths"] = out["lengths"].clamp(max=width)
    return out


# Some torch builds lack `where` or indexing for the unsigned dtypes (docs/results/reader.md); a signed view of the same
# width has the same bits. Torch < 2.3 has no such dtypes at all.
def _signed(values: torch.Tensor) -> torch.Tensor:
    return values.view(compat.UNSIGNED.get(values.dtype, (values.dtype,))[0])


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[index]` in the same dtype, for the unsigned dtypes too."""
    return _signed(values)[index].view(values.dtype)


def _zero_where_invalid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`values` where `valid`, else 0, in the same dtype."""
    view = _signed(values)
    return torch.where(valid, view, torch.zeros((), dtype=view.dtype, device=view.device)).view(values.dtype)


def _pad_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """``values`` with zero rows appended up to ``rows`` along dim 0, in the same dtype (unsigned ones through their
    signed view, as :func:`_take` does)."""
    view = _signed(values)
    return torch.cat([view, view.new_zeros((rows - view.shape[0], *view.shape[1:]))]).view(values.dtype)


def count_tokens(batch: HostBatch, max_len: int | None = None) -> HostBatch:
    """On the host, before the copy: a packed batch gets ``n_tokens``, how many tokens its persons keep when cropped
    to ``max_len`` (read from the host buffer: no sync), so that the device can size the packed layout without asking
    for it. A padded batch, or one already counted, comes back as is."""
    if not isinstance(batch, PackedBatch) or batch.n_tokens is not None:
        return batch
    lengths = packed_views(batch)["lengths"]
    kept = lengths if max_len is None else lengths.clamp(max=max_len)
    return batch.counted(int(kept.sum()), max_len)


# One function, over 60 lines (most of them its docstring): the padded and the packed layouts share the checks, the
# padding and the masking, and the two short endings read best beside each other.
def model_batch(
    batch: HostBatch, masker: DynamicMasker | None = None, *, epoch: int = 0, layout: str = PADDED,
    max_len: int | None = None, static: StaticShape | None = None,
) -> ModelBatch:
    """The model's batch (the seed code's layout, docs/reference/masking.md), built where ``batch`` lives,
    without a host sync.

    With ``masker`` the masks are drawn now (dynamic masking, ``epoch`` picks the draw); else the offline MLM fields
    are used when present (padded to max(floor(0.3 L), their T) target columns, so no target is ever dropped); else
    there are no targets. A packed batch is padded first (:func:`padded_fields`; to ``max_len`` when given, cropping
    longer persons). Every per-person field the model batch is not built from (the predict data's ``shard``, a field the
    dataset adds) is carried as it is; a per-token one it does not know is refused (:func:`batch.check_fields`).

    ``layout="packed"`` (a packed batch, its tokens counted by :func:`count_tokens`) then keeps only the real tokens,
    for the encoder's padding-free path: ``input_ids`` (4, N), ``original_sequence`` (N,), ``cu_seqlens`` (B+1,) int32,
    ``max_len`` (a host int: the padded width, an upper bound of the lengths) and ``target_index`` (B, T), the MLM
    targets as rows of the packed arrays (unused targets point at a real row; their token 0 is ignored by the loss).

    ``static`` (a :class:`StaticShape`; packed layout and ``max_len`` only) pads that batch to ``static.tokens`` rows
    of the packed arrays and ``static.rows(max_len)`` persons, as :class:`StaticShape` says, whatever the batch holds:
    a :class:`~lifeseq_shards.device.batch.StaticModelBatch`. Its MLM targets, drawn as above (offline ones: a
    person with more than ``floor(0.3 max_len)`` refused), none on padding, are the batch's: ``target_index`` and
    ``target_tokens`` (1, floor(ratio x ``static.tokens``)), the used targets first in person order (``ratio``: the
    masker's, 0.3 for offline targets). For training batches: ``model.pool`` (predict) counts a row's tokens by
    ``lengths``."""
    if layout not in (PADDED, PACKED):
        raise ValueError(f"layout must be {PADDED!r} or {PACKED!r}, not {layout!r}")
    check_static(static, layout, max_len)
    n_tokens = batch.n_tokens if isinstance(batch, PackedBatch) else None
    if layout == PACKED:
        if not isinstance(batch, PackedBatch) or n_tokens is None:
            raise ValueError("layout='packed' needs a packed batch counted on the host (device.count_tokens)")
        if batch.counted_for != max_len:
            # the token count sizes the gathers: for another crop they would read or write the wrong rows (CUDA
            # checks no size, to stay free of syncs)
            raise ValueError(f"the packed batch was counted for max_len={batch.counted_for} (device.count_tokens) "
                             f"but model_batch got max_len={max_len}: count with the same max_len")
    extra = check_fields(batch)
    fields = padded_fields(batch, max_len)
    persons = fields["lengths"].shape[0]
    if static is not None:
        assert n_tokens is not None and max_len is not None  # packed and counted, with a width: checked above
        rows = _static_rows(static, persons, n_tokens, max_len)
        fields = {k: _pad_rows(v, rows) for k, v in fields.items()}  # zero-length persons: no target, no token
    tokens = fields["tokens"].long()
    stamps = [fields[k].long() for k in STAMPS]
    lengths = fields["lengths"].long()
    L = tokens.shape[1]
    # per person, as read: the ids and lengths, then the fields the model batch is not built from, as they are
    out = {"person_id": fields["person_id"], "lengths": fields["lengths"]}
    out.update((k, widen_unsigned(fields[k])) for k in extra)
    shown = tokens
    if masker is not None:
        m = masker(tokens, *stamps, lengths, fields["person_id"], epoch)
        shown, tokens, stamps = m["masked_tokens"], m["original"], [m[k] for k in STAMPS]
        out.update(target_pos=m["target_pos"], target_tokens=m["target_tokens"], target_cls=m["target_cls"])
    elif all(k in fields for k in OFFLINE_MLM_FIELDS):
        shown = fields["masked_tokens"].long()
        pos, tok = fields["target_pos"].long(), fields["target_tokens"].long()
        max_targets = math.floor(DEFAULT_RATIO * L)
        if static is None:
            max_targets = max(max_targets, pos.shape[1])  # the stored targets' count decides: no target dropped
        elif pos.shape[1] > max_targets:
            raise ValueError(f"a person of the batch has {pos.shape[1]} offline MLM targets, more than the static "
                             f"shape's {max_targets} target columns (floor({DEFAULT_RATIO} x max_len={L})): "
                             "raise pad_to")
        target_pos, target_tokens = fill_targets(pos, tok, fields["n_targets"].long(), L, max_targets)
        out.update(target_pos=target_pos, target_tokens=target_tokens, target_cls=fields["target_cls"].long())
    if static is not None and "target_cls" in out:  # the padding persons' CLS never counts
        real = torch.arange(tokens.shape[0], device=tokens.device) < persons
        out["target_cls"] = torch.where(real, out["target_cls"], NO_CLS)
    if layout == PADDED:
        out["padding_mask"] = (torch.arange(L, device=tokens.device) < lengths[:, None]).long()
        out["input_ids"] = torch.stack([shown, *stamps], 1)
        out["original_sequence"] = tokens
        return PaddedModelBatch(out)
    assert n_tokens is not None
    flat = packed_cells(lengths, L, n_tokens)  # each real token's padded cell
    out["input_ids"] = torch.stack([shown, *stamps], 0).flatten(1)[:, flat]
    out["original_sequence"] = tokens.flatten()[flat]
    counts = lengths
    if static is not None:  # the padding tokens (all fields 0) after the real ones, held by the padding persons
        spare = static.tokens - n_tokens
        out["input_ids"] = torch.nn.functional.pad(out["input_ids"], (0, spare))
        out["original_sequence"] = torch.nn.functional.pad(out["original_sequence"], (0, spare))
        counts = lengths + _padding_counts(tokens.shape[0], persons, spare, L, tokens.device)
    out["cu_seqlens"] = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)).int()
    out["max_len"] = L
    if "target_pos" in out:
        out["target_index"] = (starts(lengths)[:, None] + out.pop("target_pos")).clamp(max=max(n_tokens - 1, 0))
        if static is not None:
            ratio = masker.cfg.ratio if masker is not None else DEFAULT_RATIO
            out["target_index"], out["target_tokens"] = _batch_targets(
                out["target_index"], out["target_tokens"], math.floor(ratio * static.tokens))
    return PackedModelBatch(out) if static is None else StaticModelBatch(out)


def _batch_targets(index: torch.Tensor, tokens: torch.Tensor, max_targets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, max_targets) target rows and tokens of a static batch: every person's used targets (token != 0), in
    person order, then unused ones. Each person has at most floor(ratio x its tokens) targets, so the batch at most
    floor(ratio x static tokens) = ``max_targets``: none is dropped, and the MLM head reads that many target columns,
    not floor(ratio x width) for each of the (mostly padding) person rows."""
    order = torch.sort((tokens == 0).flatten().int(), stable=True).indices[:max_targets]
    return index.flatten()[order][None], tokens.flatten()[order][None]


def _static_rows(static: StaticShape, persons: int, n_tokens: int, width: int) -> int:
    """The person rows of a batch of ``persons`` persons and ``n_tokens`` tokens (host ints) padded to ``static``;
    ValueError when it does not fit."""
    rows = static.rows(width)
    needed = persons + -(-(static.tokens - n_tokens) // width)
    if n_tokens > static.tokens or needed > rows:
        raise ValueError(f"a batch of {persons} persons and {n_tokens} tokens does not fit StaticShape(tokens="
                         f"{static.tokens}, persons={static.persons}): size it from the same lengths and budget "
                         "as the batches (plan.balance.person_rows)")
    return rows


def _padding_counts(rows: int, persons: int, spare: int, width: int, device: torch.device) -> torch.Tensor:
    """(rows,) the tokens each person row holds of the ``spare`` padding tokens: none for the ``persons`` real
    ones, then ``width`` each while they last, then none."""
    j = torch.arange(rows, device=device) - persons
    return (spare - j * width).clamp(0, width) * (j >= 0)


def without_offline_masks(batch: HostBatch) -> HostBatch:
    """``batch`` without its offline MLM fields (a packed batch's buffer is left as is: only its spans shrink),
    so :func:`model_batch` finds no offline masks to use."""
    return batch.without(OFFLINE_MLM_FIELDS)


@dataclass(frozen=True)
class BatchBuilder:
    """Host batch -> the model's batch on ``device``: :func:`count_tokens`, :func:`to_device`, :func:`model_batch`.

    ``masking``: None (no targets: offline fields dropped), :data:`~lifeseq_shards.masking.OFFLINE` (the stored
    masks) or a :class:`DynamicMasker`. ``layout``, ``max_len`` and ``static``: the model batch's
    (:class:`~.shape.Padding`'s ``layout``, :attr:`~.shape.Padding.max_len` and ``static``; give ``static`` to the
    training batches' builder). The two halves are separate because Lightning calls them as two hooks
    (transfer_batch_to_device, on_after_batch_transfer); a :class:`~lifeseq_shards.device.batch.ModelBatch` (one
    :class:`DevicePrefetcher` built ahead) passes through both as it is.
    """

    masking: DynamicMasker | Offline | None = None
    layout: str = PADDED
    max_len: int | None = None
    static: StaticShape | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "masking", Offline.of(self.masking))  # the word "offline" says OFFLINE here too
        check_static(self.static, self.layout, self.max_len)

    def transfer(self, batch: HostBatch | ModelBatch, device: torch.device | str) -> HostBatch | ModelBatch:
        if isinstance(batch, ModelBatch):
            return batch
        return to_device(count_tokens(batch, self.max_len) if self.layout == PACKED else batch, device)

    def widen(self, batch: HostBatch | ModelBatch, epoch: int) -> ModelBatch:
        if isinstance(batch, ModelBatch):
            return batch
        if self.masking is None:
            batch = without_offline_masks(batch)
        masker = self.masking if isinstance(self.masking, DynamicMasker) else None
        return model_batch(batch, masker, epoch=epoch, layout=self.layout, max_len=self.max_len, static=self.static)

    def __call__(self, batch: HostBatch, device: torch.device | str, epoch: int) -> ModelBatch:
        return self.widen(self.transfer(batch, device), epoch)


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

