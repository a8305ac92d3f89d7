"""The reference model as a LightningModule (:class:`PretrainSteps`): MLM + CLS pre-training of
:class:`~lifeseq_shards.encoder.LifeSeqEncoder` on the model's batch, validation, and embeddings for predict.

It exists so the data path can be measured under a real training step (tools/train_bench.py) and as a working
baseline; the encoder, its sizes and its attention are :mod:`lifeseq_shards.encoder`'s (re-exported here: the
constructor takes a size of :data:`SIZES` or an :class:`EncoderConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .device.batch import ModelBatch, PackedModelBatch, StaticModelBatch
from .encoder import SIZES, EncoderConfig, LifeSeqEncoder, Packed, model_flops_per_token, resolve_size
from .schedule import resize_one_cycle
from .store.format import PAD

__all__ = ["SIZES", "EncoderConfig", "LifeSeqEncoder", "LifeSeqPretrainModule", "PretrainSteps",
           "model_flops_per_token", "model_inputs", "pool", "pretrain_losses", "resolve_size"]


def pool(states: Tensor, layout: Tensor | Packed, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(CLS, mean) embeddings (B, hidden) in fp32 from the encoder's states: each person's first token's state,
    and the mean over its real tokens (a person without tokens gets zeros), as the seed's ``infer_embedding.py``
    pools them. ``layout``: the padding mask (padded states (B, L, hidden)) or :class:`Packed` ((N, hidden));
    ``lengths``: each person's real tokens (B,)."""
    states = states.float()
    if isinstance(layout, Packed):
        starts = layout.cu_seqlens[:-1].long()
        person = torch.repeat_interleave(torch.arange(lengths.shape[0], device=states.device), lengths.long(),
                                         output_size=states.shape[0])
        total = states.new_zeros(lengths.shape[0], states.shape[1]).index_add_(0, person, states)
        first = states[starts.clamp(max=max(states.shape[0] - 1, 0))] if states.shape[0] else total
    else:
        real = layout.bool().unsqueeze(-1)
        total, first = (states * real).sum(1), states[:, 0]
    count = lengths.to(states.dtype).clamp(min=1).unsqueeze(-1)
    return first * (lengths > 0).unsqueeze(-1), total / count


def model_inputs(batch: Mapping[str, Any]) -> tuple[Tensor, Tensor | Packed, Tensor | None]:
    """The encoder's (input_ids, layout, targets) from a model batch (device.model_batch) of either layout (any
    other mapping is read as the padded one); targets None in a batch without them (predict)."""
    if isinstance(batch, PackedModelBatch):
        return batch["input_ids"], Packed(batch["cu_seqlens"], batch["max_len"]), batch.get("target_index")
    return batch["input_ids"], batch["padding_mask"], batch.get("target_pos")


def pretrain_losses(model: nn.Module, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    """MLM cross-entropy over the used targets (token 0 marks an unused target) and CLS cross-entropy, of
    ``model`` (a :class:`LifeSeqEncoder`) on a model ``batch`` with targets.

    The MLM loss is the sum over the used targets divided by their count, at least 1: a batch without any target
    (short persons, ``ratio=0``) gets 0, not the NaN of a mean over nothing, which would turn every weight NaN at
    the next optimizer step. The count stays on the device (no sync)."""
    mlm, cls = model(*model_inputs(batch))
    targets = batch["target_tokens"].flatten()
    total = F.cross_entropy(mlm.flatten(0, 1).float(), targets, ignore_index=PAD, reduction="sum")
    mlm_loss = total / (targets != PAD).sum().clamp(min=1)
    return mlm_loss, F.cross_entropy(cls.float(), batch["target_cls"])


class PretrainSteps:
    """The reference model as a LightningModule: MLM + CLS pre-training, validation, and embeddings for predict.

    ``LifeSeqPretrainModule(size, vocab_size, lr=1e-3, weight_decay=0.01, dropout=0.1, pct_start=0.1,
    compile=False)``: ``size`` is a name of :data:`SIZES` (the seed's ``small`` / ``medium`` / ``large`` and their
    tensor-core roundings ``*-tc``) or an :class:`EncoderConfig` (hidden, ff, layers, heads); ``vocab_size`` the
    dataset's (``LifeSeqDataModule.vocab_size``). AdamW at ``lr`` with OneCycleLR (``pct_start`` warm-up) over this
    rank's steps. ``compile=True`` compiles the encoder only (the loss and the Lightning glue stay eager).

    - ``forward(batch)``: the encoder's token states, (B, L, hidden) for a padded model batch, (N, hidden) packed.
    - ``training_step`` / ``validation_step``: MLM + CLS losses (the batch needs targets: a DataModule with
      masking), logged per epoch as ``train/*`` and ``val/*``; no step waits for the device.
    - ``predict_step``: ``{"person_id", "cls", "mean"}`` per person (:func:`pool`; no collective, since ranks may
      differ in predict batches), what :class:`lifeseq_shards.EmbeddingWriter` writes (``embedding_fields()``).

    The behaviour of ``LifeSeqPretrainModule`` for either Lightning package: the classes add only the
    LightningModule base a Trainer checks for (this module's for ``import lightning``, ``lifeseq_shards.pl``'s for
    ``import pytorch_lightning``).
    """

    hparams: Any  # the flavour's LightningModule provides these
    trainer: Any

    def __init__(
        self,
        size: str | EncoderConfig,
        vocab_size: int,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        dropout: float = 0.1,
        pct_start: float = 0.1,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = resolve_size(size)
        self.encoder = LifeSeqEncoder(self.cfg, vocab_size, dropout)
        if compile:
            self.encoder.compile()  # in place: parameter names and checkpoints stay those of the eager model

    def _mark_dynamic(self, batch: ModelBatch) -> None:
        if self.hparams.compile and isinstance(batch, PackedModelBatch) and not isinstance(batch, StaticModelBatch):
            # the packed token count changes every batch: compile for any count at once, not once per count (a static
            # batch's never changes, and a step compiled for its one shape can be captured as a CUDA graph)
            torch._dynamo.maybe_mark_dynamic(batch["input_ids"], 1)

    def forward(self, batch: ModelBatch) -> Tensor:
        self._mark_dynamic(batch)
        input_ids, layout, _ = model_inputs(batch)
        return self.encoder.encode(input_ids, layout)

    def _losses(self, batch: ModelBatch, stage: str, sync: bool) -> Tensor:
        self._mark_dynamic(batch)
        mlm_loss, cls_loss = pretrain_losses(self.encoder, batch)
        loss = mlm_loss + cls_loss
        # on_step=False: the values are summed on the device and read once per epoch, so no step blocks on them.
        n = batch["target_cls"].shape[0]
        log = {"on_step": False, "on_epoch": True, "sync_dist": sync, "batch_size": n}
        self.log(f"{stage}/loss", loss.detach(), **log)
        self.log(f"{stage}/mlm_loss", mlm_loss.detach(), **log)
        self.log(f"{stage}/cls_loss", cls_loss.detach(), **log)
        return loss

    def training_step(self, batch: ModelBatch, batch_idx: int) -> Tensor:
        return self._losses(batch, "train", sync=False)

    def validation_step(self, batch: ModelBatch, batch_idx: int) -> Tensor:
        # sync_dist: the epoch's value is averaged over ranks once, at its end (every rank has as many val batches)
        return self._losses(batch, "val", sync=True)

    def predict_step(self, batch: ModelBatch, batch_idx: int) -> dict[str, Tensor]:
        _, layout, _ = model_inputs(batch)
        cls, mean = pool(self(batch), layout, batch["lengths"])
        return {"person_id": batch["person_id"], "cls": cls, "mean": mean}

    def embedding_fields(self) -> dict[str, int]:
        """What :meth:`predict_step` returns per person besides its id: name -> width."""
        return {"cls": self.cfg.hidden, "mean": self.cfg.hidden}

    def configure_optimizers(self) -> dict:
        """AdamW (no decay on biases and norms) + OneCycleLR over this rank's steps.

        `estimated_stepping_batches` counts the optimizer steps *this rank* takes (per-rank loader length x epochs /
        accumulation, or max_steps): sizing OneCycleLR from the unsplit dataset's length would give a schedule
        `world_size` times too long, so a DDP run would end in its warm-up phase (docs/results/training-gpu.md).
        """
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        # fused on CUDA: one kernel per parameter group instead of a dozen foreach launches each
        # (docs/results/training-gpu.md)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr, fused=all(p.is_cuda for p in self.parameters()) or None,
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("OneCycleLR needs a finite number of steps: set max_steps or give the loader a length")
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.hparams.lr, total_steps=int(total), pct_start=self.hparams.pct_start
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        """A fit resumed in another arrangement (ranks, workers, batch size; docs/reference/ddp.md) has other steps left
        than the checkpoint's OneCycleLR was sized for: fit it to this arrangement's (nothing changes otherwise)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "schedule_steps"):
            resize_one_cycle(self.lr_schedulers(), *datamodule.schedule_steps())


class LifeSeqPretrainModule(PretrainSteps, L.LightningModule):
    """:class:`PretrainSteps` for a `lightning` Trainer."""
