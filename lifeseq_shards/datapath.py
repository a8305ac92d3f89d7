"""What the Lightning DataModule and the plain loop's :class:`~lifeseq_shards.loop.LifeSeqData` both build from a
converted dataset, written once: the masking checked against the manifest, the batch builders (training's and
predict's), this rank's train / val / predict loaders and the choice of prefetching. Each front end adds only where
its rank, world size, epoch and device come from (a Trainer, or the process and its own counters).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .device.batch import check_schema
from .device.build import BatchBuilder
from .device.prefetch import DevicePrefetcher, on_device, prefetch_choice
from .device.shape import PACKED, PADDED, Padding, StaticShape
from .embed.store import expected_shards
from .masking import EAGER, OFFLINE, DynamicMasker, MaskingConfig, Offline
from .plan.balance import person_rows
from .plan.partition import COMPLETE, EVEN, EXACT
from .reader import ShardedDataset, ShardedLoader, World
from .reader.options import ReadOptions, predict_splits
from .reader.state import read_state, saved_epoch
from .store.lengths import split_lengths
from .store.manifest import Manifest
from .store.remote import read_manifest

if TYPE_CHECKING:  # the plain loop loads no Lightning
    from .embed.writer import EmbeddingWriterHooks

# why an offline-MLM dataset neither takes a new CLS task nor serves predict
_AFTER_CLS_TASK = ("converted from an offline-MLM file, whose sequences are stored after the seed's CLS task (about "
                   "10% with their events reversed or shuffled)")


def resolve_masking(masking: str | Offline | MaskingConfig | DynamicMasker | None, manifest: Manifest,
                    root: str) -> Offline | MaskingConfig | None:
    """The masking with the dataset's vocabulary size filled in (random replacements are drawn below it); a
    configuration that names another size is refused, since ids past the model's embedding crash it. A
    :class:`DynamicMasker` stands for its configuration; the word ``"offline"`` for :data:`OFFLINE`."""
    if isinstance(masking, DynamicMasker):
        masking = masking.cfg
    masking = Offline.of(masking)
    if masking is OFFLINE:
        if not manifest.offline_mlm:
            raise ValueError(f"{root}: masking='offline' but the dataset has no offline MLM fields")
        return masking
    if masking is None:
        return None
    if not isinstance(masking, MaskingConfig):
        raise ValueError(f"masking must be None, 'offline' (OFFLINE) or a MaskingConfig, not {masking!r}")
    if masking.cls_task and manifest.offline_mlm:
        # ~10% of the stored sequences are already reversed or shuffled: a new CLS task would mislabel them
        raise ValueError(f"{root}: {_AFTER_CLS_TASK}, so a new CLS task would label them wrongly: convert "
                         "encoded_nomlm.h5 (or the step-4 parquet) for dynamic masking, or pass "
                         "MaskingConfig(cls_task=False)")
    vocab = manifest.vocab_size
    if masking.vocab_size is None:
        if vocab is None:
            raise ValueError(f"{root}: the manifest has no vocab_size (an .h5 converted without --vocab): reconvert "
                             "with --vocab vocab.csv, or pass MaskingConfig(vocab_size=<number of token ids>)")
        return dataclasses.replace(masking, vocab_size=vocab)
    if vocab is not None and masking.vocab_size != vocab:
        raise ValueError(f"{root}: MaskingConfig(vocab_size={masking.vocab_size}) but the dataset's vocabulary has "
                         f"{vocab} ids (manifest params.vocab_size): leave vocab_size unset to take the dataset's")
    return masking


def _masker(given: str | Offline | MaskingConfig | DynamicMasker | None,
            resolved: Offline | MaskingConfig | None) -> Offline | DynamicMasker | None:
    """The device's masker for ``resolved`` (the masking :func:`resolve_masking` returned for ``given``), launched as
    a given :class:`DynamicMasker` is (eager, compiled or CUDA-graphed)."""
    if not isinstance(resolved, MaskingConfig):
        return resolved
    return DynamicMasker(resolved, given.launch if isinstance(given, DynamicMasker) else EAGER)


@dataclass(frozen=True)
class Reading:
    """How every loader of a data path reads, fixed once at construction: ``options``, the training loader's (the
    train split, balanced, shuffled; the other loaders replace what differs), and the loader's settings (the
    ``LifeSeqDataModule`` arguments of the same names)."""

    data_dir: str
    options: ReadOptions
    pin_memory: bool
    persistent_workers: bool
    batches_per_message: int | None  # None: ShardedLoader's default

    def loader(self, manifest: Manifest, world: World, **changes: Any) -> ShardedLoader:
        """A loader for ``world``'s rank, over the manifest read once, of the training options with ``changes``."""
        ds = ShardedDataset(self.data_dir, self.options, world=world, manifest=manifest, **changes)
        extra: dict[str, Any] = {"persistent_workers": self.persistent_workers} if ds.num_workers else {}
        return ShardedLoader(ds, pin_memory=self.pin_memory and torch.cuda.is_available(),
                             batches_per_message=self.batches_per_message, **extra)


@dataclass(frozen=True)
class DataConfig:
    """A front end's arguments resolved against its dataset in one step (:meth:`resolve`): the manifest read once,
    the masking checked against it, the predict splits, the padding and the prefetch choice. Each part a front end
    builds takes its values from here; none is derived again."""

    manifest: Manifest
    reading: Reading
    padding: Padding
    masking: Offline | MaskingConfig | None
    masker: Offline | DynamicMasker | None  # the device's: the masking, launched as a given DynamicMasker is
    predict_splits: tuple[str, ...]
    prefetch: str | None  # device.prefetch.PREFETCH, or None: by the device (prefetch.on_device)

    @classmethod
    def resolve(cls, reading: Reading, padding: Padding, masking: str | Offline | MaskingConfig | DynamicMasker | None,
                predict_split: str | Sequence[str] | None, prefetch: str | bool | None) -> DataConfig:
        """Read ``reading.data_dir``'s manifest and resolve the rest against it (refusing what it cannot hold)."""
        prefetch = prefetch_choice(prefetch)  # checked before the manifest is read
        root = reading.data_dir
        manifest = read_manifest(root)
        resolved = resolve_masking(masking, manifest, root)
        check_schema(manifest.schema, root)  # a field the model batch cannot hold: refused now
        # the packed layout crops on the device, where no person can be named
        if manifest.offline_mlm and padding.max_len is not None:
            raise ValueError("pad_to would crop sequences whose offline MLM targets point past the crop; use "
                             "layout='padded' (it refuses only a person longer than pad_to, by name)")
        return cls(manifest, reading, padding, resolved, _masker(masking, resolved),
                   predict_splits(manifest, predict_split), prefetch)


def static_shape(config: DataConfig, tokens_per_batch: int | None) -> StaticShape:
    """The one shape of every training batch of a token budget (``static_shapes=True``): the budget's token
    positions and room for the most persons a batch of the train split can hold
    (:func:`~lifeseq_shards.plan.balance.person_rows`, each person counted up to the crop, as the plan counts)."""
    padding = config.padding
    if not tokens_per_batch or padding.layout != PACKED or padding.pad_to is None:
        raise ValueError("static_shapes=True pads each training batch to the token budget: it needs "
                         "tokens_per_batch, layout='packed' and pad_to (the width, part of the step's shape); got "
                         f"tokens_per_batch={tokens_per_batch}, layout={padding.layout!r}, pad_to={padding.pad_to}")
    lengths, _ = split_lengths(config.reading.data_dir, config.manifest, "train")
    return StaticShape(tokens_per_batch, person_rows(np.minimum(lengths, padding.pad_to), tokens_per_batch))


class DataParts:
    """The configuration both front ends take (``LifeSeqDataModule``'s arguments; its docstring says what each
    does), resolved once into a :class:`DataConfig` (:attr:`config`), the parts built from it, and this rank's
    loaders. A front end says where its :class:`World` (:meth:`_world`) and its epoch (:meth:`_epoch`) come from."""

    def __init__(self, data_dir: str | os.PathLike[str], batch_size: int = 256, num_workers: int = 2, *,
                 seed: int = 0, masking: str | Offline | MaskingConfig | DynamicMasker | None = None,
                 pad_to: int | None = None,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 predict_split: str | tuple[str, ...] | None = None, drop_last: bool = False,
                 batches_per_message: int | None = None, layout: str = PADDED,
                 prefetch: str | bool | None = None, tokens_per_batch: int | None = None,
                 balance: str = "tokens", static_shapes: bool = False, restart_epoch: bool = False) -> None:
        super().__init__()
        padding = Padding(layout, pad_to)
        train = ReadOptions(split="train", batch_size=batch_size, num_workers=num_workers, mode=EVEN,
                            shuffle=True, seed=seed, drop_last=drop_last, pad_to=padding.host_pad_to,
                            packed=padding.host_packed, tokens_per_batch=tokens_per_batch, balance=balance,
                            crop=padding.max_len)
        reading = Reading(str(data_dir), train, pin_memory, persistent_workers, batches_per_message)
        self.config = DataConfig.resolve(reading, padding, masking, predict_split, prefetch)
        static = static_shape(self.config, tokens_per_batch) if static_shapes else None
        self.builder = BatchBuilder(self.config.masker, layout, padding.max_len, static)
        # validation's batches of persons may hold more tokens than the budget: never the training's static shape
        self.val_builder = BatchBuilder(self.config.masker, layout, padding.max_len) if static else self.builder
        self.predict_builder = BatchBuilder(None, layout, padding.max_len)  # predict embeds the sequences as they are
        self._train: ShardedLoader | DevicePrefetcher | None = None  # the last train loader built (checkpoints)
        self._resume: dict[str, Any] | None = None  # a restored position waiting for the train loader
        # (epoch, the checkpoint's batch, this arrangement's batch) of a position restored from another arrangement
        self._renumber: tuple[int, int, int] | None = None
        # a checkpoint's position is not resumed: its epoch starts over (for one that cannot be resumed exactly)
        self.restart_epoch = restart_epoch

    # -- the configuration's values, read where the parts and the front ends need them ---------------------------
    @property
    def data_dir(self) -> str:
        return self.config.reading.data_dir

    @property
    def manifest(self) -> Manifest:
        return self.config.manifest

    @property
    def masking(self) -> Offline | MaskingConfig | None:
        """The masking resolved against the dataset (a :class:`MaskingConfig` with its ``vocab_size``)."""
        return self.config.masking

    @property
    def vocab_size(self) -> int | None:
        return self.config.manifest.vocab_size

    @property
    def offline_mlm(self) -> bool:
        return self.config.manifest.offline_mlm

    @property
    def predict_splits(self) -> tuple[str, ...]:
        return self.config.predict_splits

    def _world(self) -> World:
        raise NotImplementedError

    def _epoch(self) -> int:
        raise NotImplementedError

    def _loader(self, **changes: Any) -> ShardedLoader:
        return self.config.reading.loader(self.config.manifest, self._world(), **changes)

    def _train_loader(self) -> ShardedLoader:
        """The train split shuffled, at the front end's epoch, or at the restored position waiting for it."""
        loader = self._loader()
        if self._resume is not None:
            self._load_position(loader, self._resume)
            self._resume = None
        else:  # a loader built again (reload_dataloaders_every_n_epochs) goes on with the trainer's epoch, not 0
            loader.set_epoch(self._epoch())
        return loader

    def _load_position(self, loader: ShardedLoader | DevicePrefetcher, state: dict[str, Any]) -> None:
        """Load a saved position; one saved in another arrangement starts the rest of its epoch at another batch number
        (this arrangement's), which a front end with a count of its own (Lightning's) moves to (``_renumber``). With
        ``restart_epoch`` only the saved epoch is read, and that epoch starts over at its first batch."""
        if self.restart_epoch:
            epoch, then = saved_epoch(state, str(self.data_dir))
            (loader.loader if isinstance(loader, DevicePrefetcher) else loader).set_epoch(epoch)
            self._renumber = (epoch, then, 0) if then else None
            if then:
                warnings.warn(f"{self.data_dir}: epoch {epoch} starts over (restart_epoch=True): the {then} batches "
                              "of it trained before the checkpoint are trained again", stacklevel=2)
            return
        loader.load_state_dict(state)
        at, then = loader.position, read_state(state, str(self.data_dir)).position.batches
        self._renumber = (at.epoch, then, at.batches) if at.batches != then else None

    def _prefetch(self, device: torch.device) -> str:
        """How training batches are built on ``device`` (``prefetch``: by default a step ahead on CUDA, else not)."""
        return on_device(self.config.prefetch, device)

    def _val_loader(self) -> ShardedLoader:
        # every val person once, the same batches on every rank (a sync_dist log waits for every rank), or refused
        return self._loader(split="val", mode=EXACT, shuffle=False, drop_last=False, tokens_per_batch=None)

    def _check_predictable(self) -> None:
        if self.offline_mlm:
            raise ValueError(
                f"{self.data_dir}: {_AFTER_CLS_TASK}: predict would embed those. Predict "
                "from the unmasked file converted (encoded_nomlm.h5, or the step-4 parquet)")

    def _predict_loader(self, skip_files: Collection[str] = (), shard_field: bool = False) -> ShardedLoader:
        self._check_predictable()
        return self._loader(split=self.predict_splits, mode=COMPLETE, shuffle=False, drop_last=False,
                            skip_files=skip_files, shard_field=shard_field, tokens_per_batch=None)

    def _left_to_embed(self, writer: EmbeddingWriterHooks, model: torch.nn.Module | None) -> ShardedLoader:
        """The predict data ``writer`` needs: only the shards it has not written, each person with its shard. Rank 0
        says how many are done, once (every rank reads the same count), so that a resumed job's short pass, or a
        rank with no batches, does not read like a failure."""
        self._check_predictable()  # before the writer opens its directory
        world = self._world()
        done = writer.open(self.data_dir, self.predict_splits, model, world, manifest=self.manifest)
        if world.rank == 0:
            assert writer.spec is not None
            total = len(expected_shards(self.manifest, writer.spec.splits))
            print(f"EmbeddingWriter {writer.out_dir}: {len(done)} of {total} shards done, reading "
                  f"{total - len(done)}", file=sys.stderr, flush=True)
        return self._predict_loader(skip_files=done, shard_field=True)
