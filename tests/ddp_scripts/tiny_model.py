"""The tiny LightningModule of lightning_fit.py, in its own module so that the script's DataLoader workers (spawned
ones re-import the script under ddp_spawn) need not import Lightning."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from gather import gather_to_json
from torch import nn

TOKEN_IDS = 2**16  # the shards store tokens as uint16


class Tiny(L.LightningModule):
    """Mean-pooled token embeddings -> one output; records which persons each step saw."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.embed = nn.Embedding(TOKEN_IDS, 4)
        self.head = nn.Linear(4, 1)
        self.train_ids: list[list[int]] = []
        self.val_ids: list[list[int]] = []
        self.predict_ids: list[list[int]] = []
        self.seed_batch: dict[str, Any] = {}

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["padding_mask"].unsqueeze(-1).float()
        pooled = (self.embed(batch["input_ids"][:, 0]) * mask).sum(1) / mask.sum(1)
        return self.head(pooled).pow(2).mean()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not self.seed_batch:
            ids = batch["input_ids"]
            self.seed_batch = {"input_ids": [str(ids.dtype), list(ids.shape)],
                               "padding_mask": [str(batch["padding_mask"].dtype), list(batch["padding_mask"].shape)],
                               "real_tokens": int(batch["padding_mask"].sum()), "lengths": int(batch["lengths"].sum())}
        self.train_ids.append(batch["person_id"].tolist())
        return self._loss(batch)

    def on_validation_epoch_start(self) -> None:
        self.val_ids = []  # drop the sanity check's batches

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_ids.append(batch["person_id"].tolist())
        self.log("val_loss", self._loss(batch), sync_dist=True)  # a collective per step: unequal counts would hang

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.predict_ids.append(batch["person_id"].tolist())  # no collective here: ranks may differ in batches

    def on_predict_epoch_end(self) -> None:
        gather_to_json({"rank": self.trainer.global_rank, "predict": self.predict_ids}, self.out)

    def on_train_epoch_end(self) -> None:
        trainer = self.trainer
        gather_to_json({"rank": trainer.global_rank, "world_size": trainer.world_size,
                        "num_training_batches": trainer.num_training_batches,
                        "num_val_batches": trainer.num_val_batches, "train": self.train_ids, "val": self.val_ids,
                        "seed_batch": self.seed_batch}, self.out)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
