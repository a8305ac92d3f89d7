"""A LightningDataModule over a converted dataset: rank and world size from the Trainer, exact per-rank lengths,
packed narrow batches over the bus (only real tokens), the seed's batch (and dynamic MLM masks) built on the
device."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch

from .device import PACKED, BatchBuilder, DevicePrefetcher
from .format import read_manifest
from .masking import DynamicMasker, MaskingConfig
from .reader import INFERENCE, TRAIN, ShardedDataset, ShardedLoader


class LifeSeqDataModule(L.LightningDataModule):
    """Drop-in data for the seed's ``pretrain.py`` (docs/ddp.md lists the lines to change).

    ``masking``: None (no MLM targets), ``"offline"`` (the masks converted from the seed's encoded_mlm.h5, bit for
    bit), or a :class:`MaskingConfig` (fresh masks every epoch, drawn on the device from (seed, epoch, person id)).
    Validation reads the val split without shuffling but with the training plan, so every rank gets the same number
    of batches (a val step that logs with ``sync_dist=True`` would otherwise hang); predict reads every person once
    (train and val with their remainders, unless ``predict_split`` names others).

    ``layout="packed"`` hands the model only the real tokens (``device.seed_batch``; ``pad_to`` then crops without
    padding) for the encoder's padding-free path. ``prefetch`` (default: on when training on CUDA) builds the next
    training batch on a side CUDA stream during the current step (``device.DevicePrefetcher``).
    """

    def __init__(self, data_dir: str | os.PathLike[str], batch_size: int = 256, num_workers: int = 2, *,
                 seed: int = 0, masking: str | MaskingConfig | None = None, pad_to: int | None = None,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 predict_split: str | tuple[str, ...] | None = None, drop_last: bool = False,
                 batches_per_message: int | None = None, layout: str = "padded",
                 prefetch: bool | None = None) -> None:
        super().__init__()
        self.data_dir, self.batch_size, self.num_workers = str(data_dir), batch_size, num_workers
        self.seed, self.pad_to, self.drop_last = seed, pad_to, drop_last
        self.pin_memory, self.persistent_workers = pin_memory, persistent_workers
        self.batches_per_message = batches_per_message  # None: ShardedLoader's default (~4,096 persons)
        self.manifest = read_manifest(self.data_dir)
        # predict embeds every person by default: train and val together, remainders included
        self.predict_split = predict_split or tuple(s for s in ("train", "val") if s in self.manifest["splits"])
        has_offline = any(f["name"] == "masked_tokens" for f in self.manifest["schema"])
        if masking == "offline" and not has_offline:
            raise ValueError(f"{self.data_dir}: masking='offline' but the dataset has no offline MLM fields")
        if has_offline and layout == PACKED and pad_to is not None:  # the reader refuses this for padded batches
            raise ValueError("pad_to would crop sequences whose offline MLM targets point past the crop")
        self.masking = masking
        masker = DynamicMasker(masking) if isinstance(masking, MaskingConfig) else masking
        self.builder = BatchBuilder(masker, layout, pad_to if layout == PACKED else None)
        self.prefetch = prefetch
        self.vocab_size: int | None = self.manifest.get("params", {}).get("vocab_size")

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _loader(self, split: str, mode: str, shuffle: bool) -> ShardedLoader:
        rank, world = self._rank_world()
        ds = ShardedDataset(self.data_dir, split, self.batch_size, rank=rank, world_size=world,
                            num_workers=self.num_workers, mode=mode, shuffle=shuffle, seed=self.seed,
                            drop_last=self.drop_last and mode == TRAIN,
                            pad_to=None if self.builder.layout == PACKED else self.pad_to,
                            packed=self.pad_to is None or self.builder.layout == PACKED)
        extra: dict[str, Any] = {"persistent_workers": self.persistent_workers} if self.num_workers else {}
        return ShardedLoader(ds, pin_memory=self.pin_memory and torch.cuda.is_available(),
                             batches_per_message=self.batches_per_message, **extra)

    def train_dataloader(self) -> ShardedLoader | DevicePrefetcher:
        loader = self._loader("train", TRAIN, shuffle=True)
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        if not (self.prefetch if self.prefetch is not None else device.type == "cuda"):
            return loader
        return DevicePrefetcher(loader, lambda batch: self.builder(batch, device, self._epoch()), device)

    def val_dataloader(self) -> ShardedLoader:
        return self._loader("val", TRAIN, shuffle=False)

    def predict_dataloader(self) -> ShardedLoader:
        return self._loader(self.predict_split, INFERENCE, shuffle=False)

    def _epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return self.builder.transfer(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.builder.widen(batch, self._epoch())
