"""The LightningModule of lightning_fit.py, written the way the researchers write theirs (their
``TransformerEncoder``): a ``transformer`` that turns ``input_ids`` and ``padding_mask`` into token states, a loss on
``target_tokens`` / ``target_cls`` when the batch has them, ``val_loss_track`` logged with ``sync_dist=True``, AdamW
+ OneCycleLR over ``self.trainer.estimated_stepping_batches``, and the ``predict_step`` docs/reference/ddp.md shows
(CLS and mean embeddings, as their ``infer_embedding.py`` computes them). Tiny, and it records which persons each
step saw.

It imports ``pytorch_lightning as pl`` as the researchers do when LIFESEQ_FLAVOUR=pytorch_lightning, else
``lightning.pytorch as pl``. It is a module of its own so that the script's DataLoader workers (spawned ones
re-import the script under ddp_spawn) need not import Lightning.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from gather import gather_to_json
from torch import nn

from lifeseq_shards.schedule import resize_one_cycle

if os.environ.get("LIFESEQ_FLAVOUR") == "pytorch_lightning":
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl

TOKEN_IDS = 2**16  # the shards store tokens as uint16


class TinyTransformer(nn.Module):
    """Stands in for the seed's ``Transformer``: token states (B, L, hidden) from input_ids and padding_mask."""

    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(TOKEN_IDS, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embedding(x[:, 0]))) * padding_mask.unsqueeze(-1)


class Tiny(pl.LightningModule):
    def __init__(self, out: str, save_mid_step: tuple[int, str] | None = None) -> None:
        super().__init__()
        self.out = out
        self.save_mid_step = save_mid_step  # (step, path): a checkpoint inside that step, as SLURM's requeue saves
        self.transformer = TinyTransformer()
        self.cls_decoder = nn.Linear(4, 3)
        self.train_ids: dict[str, list[list[int]]] = {}  # epoch -> the person ids of each of its batches
        self.train_lrs: list[float] = []  # the learning rate of each step this run took
        # epoch -> (batch_idx in on_train_batch_start, in on_train_batch_end, batches processed then) of each step:
        # the numbers a progress bar shows
        self.train_counts: dict[str, list[tuple[int, int, int]]] = {}
        self.val_ids: list[list[int]] = []
        self.predicted: list[dict[str, Any]] = []
        self.model_batch: dict[str, Any] = {}

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        states = self.transformer(x=batch["input_ids"].long(), padding_mask=batch["padding_mask"].long())
        cls = self.cls_decoder(states[:, 0])
        if "target_cls" in batch:  # dynamic masking: the seed's targets are there
            return states.pow(2).mean() + nn.functional.cross_entropy(cls, batch["target_cls"])
        return states.pow(2).mean() + cls.pow(2).mean()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not self.model_batch:
            ids = batch["input_ids"]
            self.model_batch = {"input_ids": [str(ids.dtype), list(ids.shape)],
                               "padding_mask": [str(batch["padding_mask"].dtype), list(batch["padding_mask"].shape)],
                               "real_tokens": int(batch["padding_mask"].sum()), "lengths": int(batch["lengths"].sum()),
                               "targets": sorted(k for k in batch if k.startswith("target_"))}
        self.train_ids.setdefault(str(self.current_epoch), []).append(batch["person_id"].tolist())
        self.train_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        loss = self._loss(batch)
        if self.save_mid_step is not None and self.trainer.global_step == self.save_mid_step[0]:
            # Lightning's SLURM handler (SIGUSR1) calls save_checkpoint wherever the step stands
            self.trainer.save_checkpoint(self.save_mid_step[1])
            self.save_mid_step = None
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.train_counts.setdefault(str(self.current_epoch), []).append((batch_idx, -1, -1))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        start = self.train_counts[str(self.current_epoch)][-1][0]
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        self.train_counts[str(self.current_epoch)][-1] = (start, batch_idx, processed)

    def on_validation_epoch_start(self) -> None:
        self.val_ids = []  # drop the sanity check's batches

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_ids.append(batch["person_id"].tolist())
        self.log("val_loss_track", self._loss(batch), sync_dist=True)  # a collective per step: unequal counts hang

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        # docs/reference/ddp.md's predict_step for the seed's model, line for line
        outputs = self.transformer(x=batch["input_ids"].long(), padding_mask=batch["padding_mask"].long())
        padding_mask = batch["padding_mask"].bool().unsqueeze(-1)
        mean_emb = (outputs * padding_mask).sum(dim=1) / padding_mask.sum(dim=1).clamp(min=1)
        # what the test checks; no collective here: ranks may differ in batches
        tokens = [row[:n].tolist() for row, n in zip(batch["input_ids"][:, 0], batch["lengths"].tolist(), strict=True)]
        self.predicted.append({"ids": batch["person_id"].tolist(), "keys": sorted(batch), "tokens": tokens})
        return {"sequence_id": batch["person_id"], "cls_emb": outputs[:, 0, :], "mean_emb": mean_emb}

    def on_predict_epoch_end(self) -> None:
        gather_to_json({"rank": self.trainer.global_rank, "predict": self.predicted}, self.out)

    def on_train_start(self) -> None:
        # docs/reference/ddp.md: a fit resumed in another arrangement has other steps left than the checkpoint's
        # schedule
        done, total = self.trainer.datamodule.schedule_steps()
        resize_one_cycle(self.lr_schedulers(), done, total)

    def on_train_epoch_end(self) -> None:
        trainer = self.trainer
        scheduler = self.lr_schedulers()
        gather_to_json({"rank": trainer.global_rank, "world_size": trainer.world_size,
                        "num_training_batches": trainer.num_training_batches, "lrs": self.train_lrs,
                        "schedule": [scheduler.last_epoch, scheduler.total_steps,
                                     int(trainer.estimated_stepping_batches)],
                        "num_val_batches": trainer.num_val_batches, "train": self.train_ids,
                        "train_counts": self.train_counts, "val": self.val_ids,
                        "model_batch": self.model_batch}, self.out)

    def configure_optimizers(self) -> dict[str, Any]:
        # the seed's schedule, sized as docs/reference/ddp.md says: asking for estimated_stepping_batches builds the
        # train loader before Lightning restores a checkpoint's state into it
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-3, total_steps=self.trainer.estimated_stepping_batches, three_phase=False,
            pct_start=0.05, div_factor=30)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
