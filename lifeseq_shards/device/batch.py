"""The batch on each side of the host -> device bus, as typed values whose fields come from the dataset's schema.

- The host batch (:mod:`lifeseq_shards.reader.collate` makes it): :class:`PackedBatch`, every field's values in one
  narrow buffer (ragged ones concatenated, the stamps once per run), or :class:`PaddedBatch`, the fields as narrow
  padded tensors. Each names its fields with their kind and the dtype they cross in (:class:`Span`,
  :class:`Column`), so the device side reads the kinds off the batch itself: a field is padded, repeated over its
  run or left per person by its kind, never by a list of names, and a field that crosses as the signed view of an
  unsigned dtype (torch < 2.3, :mod:`lifeseq_shards.compat`) says so by its dtype.
- The model batch (:func:`lifeseq_shards.device.build.model_batch` makes it): :class:`PaddedModelBatch` or
  :class:`PackedModelBatch`, read-only mappings of the names the researchers' code reads (``batch["input_ids"]``,
  ``batch["padding_mask"]``, ...; ``batch.input_ids`` too). A mapping, so that Lightning and torch treat it as
  they treat a dict (batch size, precision casts), and typed, so that a batch built ahead by the prefetcher is known
  by its type and passes Lightning's hooks untouched.

Which fields the model batch is built from is said once, in :data:`MODEL_FIELDS`: any other per-person field (the
predict data's ``shard``, a field a dataset adds) reaches the model batch as it is (unsigned ones widened); any
other per-token field is refused in one line naming it (:func:`check_fields`), never dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import compat
from ..store.format import RUN_LENGTH, RUNS, SCALAR, STAMPS, TARGETS, Field

# target_cls of a static batch's padding persons: torch's cross_entropy ignore_index, so the CLS loss (a mean over
# the persons it does not ignore) counts only the real persons
NO_CLS = -100
OFFLINE_MLM_FIELDS = ("masked_tokens", "target_pos", "target_tokens", "n_targets", "target_cls")
# the fields the device turns into the model batch (their batch names: a schema's "length" is "lengths");
# "n_runs" and "run_length" are consumed when the stamps are repeated over their tokens
MODEL_FIELDS = frozenset(("person_id", "lengths", "n_runs", RUN_LENGTH, "tokens", *STAMPS, *OFFLINE_MLM_FIELDS))


def batch_name(field_name: str) -> str:
    """A schema field's name in the batches: ``length`` is ``lengths`` (the seed's name), the others keep theirs."""
    return "lengths" if field_name == "length" else field_name


class Span(NamedTuple):
    """Where one field's values lie in a :class:`PackedBatch`'s buffer: ``count`` values of numpy ``dtype`` (as
    stored: the narrow dtype) from byte ``offset``; ``kind`` is the schema's (``format.SCALAR``, ``RAGGED``,
    ``TARGETS``, ``RUNS``)."""

    name: str
    dtype: str
    kind: str
    offset: int
    count: int


class Column(NamedTuple):
    """One field of a :class:`PaddedBatch`: its numpy ``dtype`` as carried and its kind (scalar: (B,); ragged:
    (B, width); targets: (B, targets' width))."""

    name: str
    dtype: str
    kind: str


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_pinned() else tensor.pin_memory()


@dataclass(frozen=True)
class PackedBatch:
    """A batch of persons in ONE uint8 ``buffer``: the fields' values (ragged ones concatenated, only real tokens)
    8-byte aligned, ``counts`` values of each of ``columns`` from byte ``offsets`` (:attr:`spans` has the three
    together); ``width`` is the padded width the device pads the ragged fields to, ``targets_width`` the targets'
    (None without offline MLM targets). A dataset's batches share one ``columns`` tuple, so a worker's message of
    several batches pickles it once.

    The buffer is a numpy array in a DataLoader worker (cheaper to move into the worker's ring or pipe than a
    tensor), a ``reader.transport.RingEntry`` on its way through the ring, a (pinned) tensor once the loader has it
    and a device tensor after :meth:`to`. ``n_tokens`` (with the crop ``counted_for`` it counts for) is filled in on
    the host by ``device.count_tokens`` for the model's packed layout."""

    buffer: Any
    columns: tuple[Column, ...]
    offsets: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    targets_width: int | None = None
    n_tokens: int | None = None
    counted_for: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # the arguments as they are: cheaper than the dataclass's state dict
        return PackedBatch, (self.buffer, self.columns, self.offsets, self.counts, self.width, self.targets_width,
                             self.n_tokens, self.counted_for)

    @property
    def spans(self) -> tuple[Span, ...]:
        return tuple(Span(*c, o, n) for c, o, n in zip(self.columns, self.offsets, self.counts, strict=True))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def nbytes(self) -> int:
        """The bytes that cross the bus."""
        return int(self.buffer.nbytes)

    def with_buffer(self, buffer: Any) -> PackedBatch:
        """The same batch with its bytes somewhere else (a ring entry, a pinned tensor, the device)."""
        return PackedBatch(buffer, self.columns, self.offsets, self.counts, self.width, self.targets_width,
                           self.n_tokens, self.counted_for)

    def counted(self, n_tokens: int, max_len: int | None) -> PackedBatch:
        return PackedBatch(self.buffer, self.columns, self.offsets, self.counts, self.width, self.targets_width,
                           n_tokens, max_len)

    def pin_memory(self) -> PackedBatch:
        """torch's pin-memory hook (a DataLoader's ``pin_memory=True``): a buffer still in numpy or in a ring is
        pinned by ``ShardedLoader`` when it copies it out."""
        return self.with_buffer(_pinned(self.buffer)) if isinstance(self.buffer, torch.Tensor) else self

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """The buffer moved as is (asynchronously when pinned); the spans stay on the host, where shapes are
        decided."""
        buf = torch.from_numpy(self.buffer) if isinstance(self.buffer, np.ndarray) else self.buffer
        return self.with_buffer(buf.to(device, non_blocking=non_blocking))

    def without(self, names: Iterable[str]) -> PackedBatch:
        """The batch without the fields ``names`` (the buffer as is: only its spans shrink)."""
        drop = set(names)
        kept = [s for s in self.spans if s.name not in drop]
        targets = self.targets_width if any(s.kind == TARGETS for s in kept) else None
        return PackedBatch(self.buffer, tuple(Column(s.name, s.dtype, s.kind) for s in kept),
                           tuple(s.offset for s in kept), tuple(s.count for s in kept), self.width, targets,
                           self.n_tokens, self.counted_for)


@dataclass(frozen=True)
class PaddedBatch:
    """A batch of persons as narrow padded tensors: ``tensors`` by name, each described in ``columns`` (a field
    whose dtype torch lacks crosses as its signed view: ``compat.is_view`` of its column's dtype)."""

    tensors: Mapping[str, torch.Tensor]
    columns: tuple[Column, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def nbytes(self) -> int:
        """The bytes that cross the bus."""
        return sum(t.nbytes for t in self.tensors.values())

    def _with(self, tensors: dict[str, torch.Tensor]) -> PaddedBatch:
        return PaddedBatch(tensors, tuple(c for c in self.columns if c.name in tensors))

    def pin_memory(self) -> PaddedBatch:
        return self._with({k: _pinned(v) for k, v in self.tensors.items()})

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PaddedBatch:
        return self._with({k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()})

    def without(self, names: Iterable[str]) -> PaddedBatch:
        drop = set(names)
        return self._with({k: v for k, v in self.tensors.items() if k not in drop})

    def widened(self) -> dict[str, torch.Tensor]:
        """The tensors by name, each signed view read back as its unsigned values (bit-exact, one dtype wider)."""
        views = self._views()
        return {k: compat.unsigned(v) if k in views else v for k, v in self.tensors.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        """One field's values as :meth:`widened` gives them: ``batch["person_id"]`` reads as it did when a padded
        host batch was a dict, and a signed view (torch < 2.3) never leaks out as negative token ids."""
        value = self.tensors[name]
        return compat.unsigned(value) if name in self._views() else value

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def _views(self) -> set[str]:
        """The fields that cross as the signed view of their unsigned dtype (torch < 2.3)."""
        return {c.name for c in self.columns if compat.is_view(c.dtype)}


HostBatch = PackedBatch | PaddedBatch


def kinds(batch: HostBatch) -> dict[str, str]:
    """Each field's kind, by batch name."""
    return {c.name: c.kind for c in batch.columns}


def check_fields(batch: HostBatch) -> list[str]:
    """The per-person fields of ``batch`` the model batch carries as they are (those the device does not build
    from); refuses, in one line naming it, a per-token field it would otherwise have to drop."""
    return extra_fields(kinds(batch).items())


def check_schema(schema: Iterable[Field], where: str = "") -> list[str]:
    """:func:`check_fields` for a dataset's schema (at ``where``, for the message), before any batch is read."""
    return extra_fields(((batch_name(f.name), f.kind) for f in schema), where)


def extra_fields(fields: Iterable[tuple[str, str]], where: str = "") -> list[str]:
    """Of ``fields`` ((batch name, kind), ...), those the model batch carries as they are; a per-token one it does
    not know is refused."""
    extra = []
    for name, kind in fields:
        if name in MODEL_FIELDS:
            continue
        if kind != SCALAR:
            per = "run of tokens" if kind == RUNS else "target" if kind == TARGETS else "token"
            raise ValueError(f"{where}{': ' if where else ''}the dataset's field {name!r} has a value per {per}, "
                             "and lifeseq_shards builds the model batch only from the fields it knows "
                             "(lifeseq_shards.device.batch.MODEL_FIELDS): "
                             f"convert without {name!r}, or store it one value per person")
        extra.append(name)
    return extra


def widen_unsigned(values: torch.Tensor) -> torch.Tensor:
    """``values`` in a dtype every torch op takes: an unsigned one wider than 8 bits in the next wider signed, as
    ``compat.unsigned`` widens their signed views, so that an extra field has the same dtype on every torch."""
    views = compat.UNSIGNED.get(values.dtype)
    return values if views is None else values.to(views[1])


class ModelBatch(Mapping[str, Any]):
    """The model's batch: a read-only mapping of name -> tensor (``max_len``, in the packed layout, a host int), in
    the names and layout the researchers' code reads (docs/reference/masking.md). ``batch["input_ids"]``,
    ``"target_pos" in batch``, ``batch.keys()``, ``dict(batch)`` and ``batch.input_ids`` all work; assignment does
    not (use :meth:`replace`). Built from any mapping (``type(batch)(mapping)``), as Lightning's and torch's
    collection helpers rebuild a mapping they convert."""

    __slots__ = ("_values",)
    _values: dict[str, Any]

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy / pickle probe dunders before _values exists
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} (it has {', '.join(self)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only: batch.replace({name}=...) gives a changed copy")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self._values,)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}" for k, v in self.items())
        return f"{type(self).__name__}({shapes})"

    def replace(self, **changes: Any) -> ModelBatch:
        """A copy with ``changes`` (name=value) made."""
        return type(self)({**self._values, **changes})


class PaddedModelBatch(ModelBatch):
    """The seed's padded batch: ``input_ids`` (B, 4, L), ``padding_mask`` (B, L), ``original_sequence`` (B, L),
    ``person_id``, ``lengths``, and with MLM targets ``target_pos`` / ``target_tokens`` (B, T), ``target_cls``."""


class PackedModelBatch(ModelBatch):
    """Only the real tokens, for the encoder's padding-free path: ``input_ids`` (4, N), ``original_sequence`` (N,),
    ``cu_seqlens`` (B+1,) int32, ``max_len`` (a host int), ``person_id``, ``lengths``, and with MLM targets
    ``target_index`` (B, T) (rows of the packed arrays), ``target_tokens``, ``target_cls``."""


class StaticModelBatch(PackedModelBatch):
    """A :class:`PackedModelBatch` padded to a ``device.shape.StaticShape``: the same shapes every batch. Its first
    persons and rows are the real ones; the padding persons after them have ``lengths`` 0, ``target_cls``
    :data:`NO_CLS` and no MLM target, and hold the padding token rows ([PAD], all stamps 0) in ``cu_seqlens``. The
    MLM targets are the batch's, not a person's: ``target_index`` and ``target_tokens`` (1, T), the used spans first
    (token 0: unused)."""
