"""The embedding writer: what a predict step returns for each person, one Parquet file per input shard, resumable.

:class:`EmbeddingWriterHooks` holds the behaviour for a plain loop and for both Lightning packages; the classes
add only the ``BasePredictionWriter`` base a Trainer checks for (``lifeseq_shards.EmbeddingWriter`` for
``import lightning``, ``lifeseq_shards.pl.EmbeddingWriter`` for ``import pytorch_lightning``). The predict data is
read in complete mode (every person once, whole shards dealt to the readers) with each person's shard in the batch
(``ShardedDataset(shard_field=True)``), so the writer knows where each person belongs and when a shard's persons
are all there, whatever the ranks, workers and batch order. A shard's rows wait in memory until then (at most a
shard per reader), are sorted by person id and written atomically (:mod:`lifeseq_shards.embed.store`). A job
started again, with any number of ranks, reads only the shards whose files are not there yet.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn

from ..reader import ShardedDataset, World
from ..reader.options import predict_splits
from ..reader.stages import SHARD_FIELD
from ..store.manifest import Manifest, ShardEntry
from ..store.remote import read_manifest
from .spec import Padding
from .store import (
    ID_COLUMN,
    EmbeddingsError,
    EmbeddingSpec,
    check_dtype,
    check_fields,
    expected_shards,
    open_output,
    write_shard,
)


def model_fingerprint(model: nn.Module) -> str:
    """32 hex digits of sha256 over the model's state (names, dtypes, shapes, bytes): the same weights in the same
    dtype give the same fingerprint, so embeddings of two models (or of one in two precisions) never share a
    directory."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


class _Shard:
    """The rows of one input shard received so far."""

    def __init__(self, entry: ShardEntry) -> None:
        self.entry, self.count = entry, 0
        self.ids: list[np.ndarray] = []
        self.arrays: list[dict[str, np.ndarray]] = []


class EmbeddingWriterHooks:
    """Writes each person's embeddings into ``out_dir``: ``<split>/<shard>.parquet`` per input shard, ``person_id``
    plus one fixed-width column per field, in ``dtype`` (``"float16"`` or ``"float32"``).

    ``fields``: name -> width of what the model's predict step returns besides the id (default: the model's
    ``embedding_fields()``, as :class:`lifeseq_shards.model.PretrainSteps` has: ``cls`` and ``mean``); ``id_key``
    names the id in its output (the seed's ``predict_step`` says ``"sequence_id"``); ``model`` names the model in
    the output manifest (default: the fingerprint of its weights). ``padding``: how the model sees each person,
    recorded in the manifest and every file's stamp (:class:`~lifeseq_shards.embed.spec.Padding`: ``"padded
    pad_to=512"``, ``"packed pad_to=512"``, ``"packed unpadded"``; a ``PackedPerformer``'s ``.padding`` says its
    own; default ``"padded"``, the length not recorded). A directory holding another dataset's, model's, fields',
    dtype's or padding's embeddings is refused.

    Lightning: add it to the Trainer's callbacks and predict with :class:`LifeSeqDataModule`, which asks it which
    shards are left (``trainer.predict(model, datamodule=dm, return_predictions=False)``). A plain loop:
    ``ds = writer.dataset(root, batch_size=..., model=model)``, then ``writer.write(model.predict_step(batch, i),
    batch)`` for each model batch, and ``writer.finish()``.
    """

    def __init__(self, out_dir: str | os.PathLike[str], fields: Mapping[str, int] | None = None,
                 dtype: str = "float32", *, model: str | None = None, id_key: str = ID_COLUMN,
                 padding: str = "padded") -> None:
        super().__init__(write_interval="batch")  # type: ignore[call-arg]  # BasePredictionWriter's
        check_dtype(dtype)
        if fields is not None:
            check_fields(fields)
        self.out_dir, self.fields, self.dtype = Path(out_dir), dict(fields) if fields else None, dtype
        self.model_name, self.id_key, self.padding = model, id_key, Padding.parse(padding)
        self.spec: EmbeddingSpec | None = None
        self.manifest: Manifest | None = None  # the data's, read once by open
        self._entries: dict[int, ShardEntry] = {}  # position among the manifest's shards -> entry, to be written
        self._open: dict[int, _Shard] = {}
        self.written: list[Path] = []  # this process's finished files, in order

    # -- opening: every rank agrees on what is left --------------------------------------------------------------
    def open(self, data: str | os.PathLike[str], splits: Sequence[str] | str | None = None,
             model: nn.Module | None = None, world: World | None = None, *,
             manifest: Manifest | None = None) -> list[str]:
        """Check (or make) the output directory for ``data``'s ``splits`` (default train and val) and ``model``,
        and return the input shards already embedded (manifest paths), for ``ShardedDataset(skip_files=...)``.
        Rank 0 looks and tells the others (torch.distributed must be initialised when there are several), so that
        every rank leaves out the same shards, whatever another rank has written meanwhile. ``world``: default
        ``World.current()``; ``manifest``: ``data``'s, when the caller has read it (read here otherwise)."""
        manifest = read_manifest(str(data)) if manifest is None else manifest
        self.manifest = manifest
        names = predict_splits(manifest, splits)
        unknown = [s for s in names if s not in manifest.splits]
        if unknown or not names:
            raise EmbeddingsError(f"{data}: no split {unknown or names!r} (has {', '.join(manifest.splits)})")
        fields = self.fields
        if fields is None:
            if model is None or not hasattr(model, "embedding_fields"):
                raise EmbeddingsError("EmbeddingWriter: pass fields={name: width, ...} (what predict_step returns "
                                      "per person besides its id), or a model with embedding_fields()")
            fields = dict(model.embedding_fields())
            check_fields(fields)
        world = World.current() if world is None else world

        def look() -> tuple[EmbeddingSpec, list[str]]:
            if self.model_name is None and model is None:
                raise EmbeddingsError("EmbeddingWriter: pass the model (its weights' fingerprint names it in the "
                                      "output manifest) or model='a name'")
            name = self.model_name if self.model_name is not None else model_fingerprint(model)
            spec = EmbeddingSpec(manifest.fingerprint, names, name, tuple(fields.items()), self.dtype, self.padding)
            return spec, open_output(self.out_dir, spec, manifest)

        self.spec, done = _on_rank_zero(look, world)
        finished = set(done)
        self._entries = {i: e for i, e in expected_shards(manifest, names) if e.file not in finished}
        self._open = {}
        return done

    def dataset(self, data: str | os.PathLike[str], split: Sequence[str] | str | None = None, *,
                model: nn.Module | None = None, **kwargs: Any) -> ShardedDataset:
        """:meth:`open`, then the :class:`ShardedDataset` of the persons left to embed (complete mode, each
        person's shard in its batch); ``kwargs`` go to ``ShardedDataset`` (batch_size, num_workers, world, ...)."""
        done = self.open(data, split, model, kwargs.get("world"), manifest=kwargs.pop("manifest", None))
        assert self.spec is not None
        return ShardedDataset(data, split=self.spec.splits, mode="complete", skip_files=done, shard_field=True,
                              manifest=self.manifest, **kwargs)

    # -- writing -----------------------------------------------------------------------------------------------
    def write(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> None:
        """Take one batch's outputs (``id_key`` and each field, (B, width)); write every shard it completes."""
        spec = self.spec
        if spec is None:
            raise EmbeddingsError("EmbeddingWriter: not opened; predict with LifeSeqDataModule (Lightning), or "
                                  "build the data with writer.dataset(...)")
        if SHARD_FIELD.name not in batch:
            raise EmbeddingsError("EmbeddingWriter: the batch has no 'shard' field: read the data with "
                                  "writer.dataset(...) or LifeSeqDataModule with this writer among the callbacks")
        if not isinstance(outputs, Mapping) or self.id_key not in outputs:
            raise EmbeddingsError(f"EmbeddingWriter: predict_step must return a dict with {self.id_key!r} and "
                                  f"{', '.join(n for n, _ in spec.fields)}; got {type(outputs).__name__}")
        ids = _numpy(outputs[self.id_key]).astype(np.int64)
        if not np.array_equal(ids, _numpy(batch["person_id"])):
            raise EmbeddingsError(f"EmbeddingWriter: the outputs' {self.id_key!r} are not the batch's person_id in "
                                  "order (return batch['person_id'] beside the embeddings)")
        arrays = {}
        for name, width in spec.fields:
            value = outputs.get(name)
            if value is None or tuple(value.shape) != (len(ids), width):
                shape = None if value is None else tuple(value.shape)
                raise EmbeddingsError(f"EmbeddingWriter: {name!r} is {shape}, expected ({len(ids)}, {width})")
            arrays[name] = _numpy(value.float() if isinstance(value, torch.Tensor) else value).astype(spec.dtype)
        shards = _numpy(batch[SHARD_FIELD.name])
        for pos in np.unique(shards).tolist():
            self._add(int(pos), shards == pos, ids, arrays)

    def _add(self, pos: int, rows: np.ndarray, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        shard = self._open.get(pos)
        if shard is None:
            if pos not in self._entries:
                raise EmbeddingsError(f"{self.out_dir}: a batch holds persons of shard #{pos}, which this job has "
                                      "finished or does not embed (read twice?)")
            shard = self._open[pos] = _Shard(self._entries.pop(pos))
        shard.ids.append(ids[rows])
        shard.arrays.append({k: v[rows] for k, v in arrays.items()})
        shard.count += int(rows.sum())
        if shard.count > shard.entry.samples:
            raise EmbeddingsError(f"{shard.entry.file}: {shard.count} persons received, it has "
                                  f"{shard.entry.samples}: persons read twice")
        if shard.count == shard.entry.samples:
            del self._open[pos]
            assert self.spec is not None
            merged = {name: np.concatenate([a[name] for a in shard.arrays]) for name, _ in self.spec.fields}
            self.written.append(write_shard(self.out_dir, shard.entry, self.spec, np.concatenate(shard.ids), merged))

    def finish(self) -> None:
        """Refuse to end with a shard half received (the data did not give all of its persons)."""
        if self._open:
            names = ", ".join(f"{s.entry.file} ({s.count}/{s.entry.samples})" for s in self._open.values())
            raise EmbeddingsError(f"{self.out_dir}: predict ended with shards incomplete: {names}; nothing of them "
                                  "was written (run again)")

    # -- Lightning's hooks -------------------------------------------------------------------------------------
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        if self.spec is None:
            raise EmbeddingsError("EmbeddingWriter: predict with datamodule=LifeSeqDataModule(...): it builds the "
                                  "predict data this writer needs (the shards left, each person's shard)")
        if trainer.predict_loop.return_predictions:
            raise EmbeddingsError("EmbeddingWriter: trainer.predict(..., return_predictions=True) keeps every "
                                  "embedding in memory as well: pass return_predictions=False")

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int = 0) -> None:
        self.write(prediction, batch)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self.finish()


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _on_rank_zero(fn: Any, world: World) -> Any:
    """``fn()`` on rank 0, its result (or its error) on every rank."""
    if world.size == 1:
        return fn()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise EmbeddingsError(f"EmbeddingWriter: {world.size} ranks but torch.distributed is not initialised: the "
                              "ranks must agree on which shards are left (init_process_group first)")
    box: list[Any] = [None]
    if world.rank == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - every rank must leave the broadcast, with the same error
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise EmbeddingsError(value)
    return value


class EmbeddingWriter(EmbeddingWriterHooks, BasePredictionWriter):
    """Writes each person's embeddings from ``Trainer.predict`` (or a plain loop) into an output directory, for a
    ``lightning`` Trainer (:class:`EmbeddingWriterHooks` documents it; ``lifeseq_shards.pl`` has the
    ``pytorch_lightning`` one)."""
