"""What the Lightning DataModule and the plain loop's :class:`~lifeseq_shards.loop.LifeSeqData` both build from a
converted dataset, written once: the masking checked against the manifest, the batch builders (training's and
predict's), this rank's train / val / predict loaders and the choice of prefetching. Each front end adds only where
its rank, world size, epoch and device come from (a Trainer, or the process and its own counters).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from .device.batch import check_schema
from .device.build import PACKED, BatchBuilder
from .device.prefetch import DevicePrefetcher
from .masking import DynamicMasker, MaskingConfig
from .plan.partition import BALANCED, COMPLETE, EXACT
from .reader import ShardedDataset, ShardedLoader, World
from .reader.state import read_state
from .store.manifest import Manifest
from .store.remote import read_manifest

# why an offline-MLM dataset neither takes a new CLS task nor serves predict
_AFTER_CLS_TASK = ("converted from an offline-MLM file, whose sequences are stored after the seed's CLS task (about "
                   "10% with their events reversed or shuffled)")


def resolve_masking(masking: str | MaskingConfig | DynamicMasker | None, manifest: Manifest,
                    root: str) -> str | MaskingConfig | None:
    """The masking with the dataset's vocabulary size filled in (random replacements are drawn below it); a
    configuration that names another size is refused, since ids past the model's embedding crash it. A
    :class:`DynamicMasker` stands for its configuration."""
    if isinstance(masking, DynamicMasker):
        masking = masking.cfg
    if masking == "offline":
        if not manifest.offline_mlm:
            raise ValueError(f"{root}: masking='offline' but the dataset has no offline MLM fields")
        return masking
    if masking is None:
        return None
    if not isinstance(masking, MaskingConfig):
        raise ValueError(f"masking must be None, 'offline' or a MaskingConfig, not {masking!r}")
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


def _masker(given: str | MaskingConfig | DynamicMasker | None,
            resolved: str | MaskingConfig | None) -> str | DynamicMasker | None:
    """The device's masker for ``resolved`` (the masking :func:`resolve_masking` returned for ``given``), launched as
    a given :class:`DynamicMasker` is (compiled, CUDA-graphed or eager)."""
    if not isinstance(resolved, MaskingConfig):
        return resolved
    if isinstance(given, DynamicMasker):
        return DynamicMasker(resolved, compile=given.compile, graph=given.graph)
    return DynamicMasker(resolved)


@dataclass(frozen=True)
class Reading:
    """How every loader of a data path reads, fixed once at construction (the settings are ``LifeSeqDataModule``'s
    arguments of the same names). ``host_pad_to``: the length the host pads (and crops) each batch to, None when
    the device does; ``bus_packed``: the host sends packed buffers of the real tokens only, which the device
    unpacks (``ShardedDataset(packed=True)``)."""

    data_dir: str
    batch_size: int
    num_workers: int
    seed: int
    drop_last: bool  # training's: validation and predict lose no one
    host_pad_to: int | None
    bus_packed: bool
    pin_memory: bool
    persistent_workers: bool
    batches_per_message: int | None  # None: ShardedLoader's default

    def loader(self, manifest: Manifest, split: str | tuple[str, ...], mode: str, shuffle: bool, world: World,
               drop_last: bool = False, **dataset: Any) -> ShardedLoader:
        """A loader of ``split`` for ``world``'s rank, over the manifest read once."""
        ds = ShardedDataset(self.data_dir, split, self.batch_size, world=world,
                            num_workers=self.num_workers, mode=mode, shuffle=shuffle, seed=self.seed,
                            drop_last=drop_last, pad_to=self.host_pad_to, packed=self.bus_packed,
                            manifest=manifest, **dataset)
        extra: dict[str, Any] = {"persistent_workers": self.persistent_workers} if self.num_workers else {}
        return ShardedLoader(ds, pin_memory=self.pin_memory and torch.cuda.is_available(),
                             batches_per_message=self.batches_per_message, **extra)


class DataParts:
    """The configuration both front ends take (``LifeSeqDataModule``'s arguments; its docstring says what each
    does), the parts built from it, and this rank's loaders. A front end says where its :class:`World`
    (:meth:`_world`) and its epoch (:meth:`_epoch`) come from."""

    def __init__(self, data_dir: str | os.PathLike[str], batch_size: int = 256, num_workers: int = 2, *,
                 seed: int = 0, masking: str | MaskingConfig | DynamicMasker | None = None,
                 pad_to: int | None = None,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 predict_split: str | tuple[str, ...] | None = None, drop_last: bool = False,
                 batches_per_message: int | None = None, layout: str = "padded",
                 prefetch: bool | None = None, prefetch_thread: bool = False) -> None:
        super().__init__()
        self.data_dir = str(data_dir)
        self.reading = Reading(self.data_dir, batch_size, num_workers, seed, drop_last,
                               None if layout == PACKED else pad_to, pad_to is None or layout == PACKED,
                               pin_memory, persistent_workers, batches_per_message)
        self.manifest = read_manifest(self.data_dir)  # once: every loader's dataset takes it
        # predict embeds every person by default: train and val together, remainders included
        self.predict_split = predict_split or tuple(s for s in ("train", "val") if s in self.manifest.splits)
        self.masking = resolve_masking(masking, self.manifest, self.data_dir)
        check_schema(self.manifest.schema, self.data_dir)  # a field the model batch cannot hold: refused now
        self.offline_mlm = self.manifest.offline_mlm
        # the packed layout crops on the device, where no person can be named
        if self.offline_mlm and layout == PACKED and pad_to is not None:
            raise ValueError("pad_to would crop sequences whose offline MLM targets point past the crop; use "
                             "layout='padded' (it refuses only a person longer than pad_to, by name)")
        masker = _masker(masking, self.masking)
        max_len = pad_to if layout == PACKED else None
        self.builder = BatchBuilder(masker, layout, max_len)
        self.predict_builder = BatchBuilder(None, layout, max_len)  # predict embeds the sequences as they are
        if prefetch_thread and prefetch is False:
            raise ValueError("prefetch_thread=True launches the prefetched batches from a thread: it needs prefetch")
        self.prefetch, self.prefetch_thread = prefetch, prefetch_thread
        self.vocab_size = self.manifest.vocab_size
        self._train: ShardedLoader | DevicePrefetcher | None = None  # the last train loader built (checkpoints)
        self._resume: dict[str, Any] | None = None  # a restored position waiting for the train loader
        # (epoch, the checkpoint's batch, this layout's batch) of a position restored from another layout
        self._renumber: tuple[int, int, int] | None = None

    def _world(self) -> World:
        raise NotImplementedError

    def _epoch(self) -> int:
        raise NotImplementedError

    def _loader(self, split: str | tuple[str, ...], mode: str, shuffle: bool, drop_last: bool = False,
                **dataset: Any) -> ShardedLoader:
        return self.reading.loader(self.manifest, split, mode, shuffle, self._world(), drop_last, **dataset)

    def _train_loader(self) -> ShardedLoader:
        """The train split shuffled, at the front end's epoch, or at the restored position waiting for it."""
        loader = self._loader("train", BALANCED, shuffle=True, drop_last=self.reading.drop_last)
        if self._resume is not None:
            self._load_position(loader, self._resume)
            self._resume = None
        else:  # a loader built again (reload_dataloaders_every_n_epochs) goes on with the trainer's epoch, not 0
            loader.set_epoch(self._epoch())
        return loader

    def _load_position(self, loader: ShardedLoader | DevicePrefetcher, state: dict[str, Any]) -> None:
        """Load a saved position; one saved in another layout starts the rest of its epoch at another batch number
        (this layout's), which a front end with a count of its own (Lightning's) moves to (``_renumber``)."""
        loader.load_state_dict(state)
        at, then = loader.position, read_state(state, str(self.data_dir)).position.batches
        self._renumber = (at.epoch, then, at.batches) if at.batches != then else None

    def _prefetching(self, device: torch.device) -> bool:
        """Whether training batches are built a step ahead: ``prefetch``, by default on CUDA."""
        return self.prefetch if self.prefetch is not None else device.type == "cuda"

    def _val_loader(self) -> ShardedLoader:
        # every val person once, the same batches on every rank (a sync_dist log waits for every rank), or refused
        return self._loader("val", EXACT, shuffle=False)

    def _check_predictable(self) -> None:
        if self.offline_mlm:
            raise ValueError(
                f"{self.data_dir}: {_AFTER_CLS_TASK}: predict would embed those. Predict "
                "from the unmasked file converted (encoded_nomlm.h5, or the step-4 parquet)")

    def _predict_loader(self, **dataset: Any) -> ShardedLoader:
        self._check_predictable()
        return self._loader(self.predict_split, COMPLETE, shuffle=False, **dataset)
