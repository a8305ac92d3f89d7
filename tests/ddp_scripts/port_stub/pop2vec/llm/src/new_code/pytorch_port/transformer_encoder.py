"""Their ``TransformerEncoder``'s interface, reporting on every rank: after each validation and at each epoch's end a
line in ``$PORT_OUT/rank<r>.jsonl`` with the global step and a digest of the weights (equal digests on every rank:
the ranks train one model).

Two stand-ins, chosen by ``$PORT_MODEL``: by default tests/ddp_scripts/plain_loop.py's tiny model (the loop's data
path and DDP, fast); ``performer``: their model's structure (tools/their_encoder.py's rebuild of their ``Transformer``
on performer-pytorch, at the tiny size with their vocabulary) with an MLM and a CLS head and their two losses, so that
the diff's packed option (``PackedPerformer`` on ``model.transformer``) runs on what it is made for."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from plain_loop import TransformerEncoder as TinyEncoder
from torch import nn

from tools.their_encoder import SIZES, TheirEncoder

CLS_WEIGHTS = (1 / 0.9, 1 / 0.1, 1 / 0.1)  # their cls_loss's class weights (label smoothing 0.1)


class Reports:
    """The per-rank report lines of the hooks their loop calls."""

    global_step: int

    def _report(self, event: str) -> None:
        digest = hashlib.sha1()
        for value in self.state_dict().values():  # type: ignore[attr-defined]
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = {"event": event, "step": self.global_step, "weights": digest.hexdigest()[:16]}
        with (Path(os.environ["PORT_OUT"]) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_validation_epoch_end(self) -> None:
        self._report("val")

    def on_train_epoch_end(self) -> None:
        self._report("epoch_end")


class TinyStandIn(Reports, TinyEncoder):
    pass


class MaskedTokens(nn.Module):
    """An MLM head with their decoder's call: the states at ``batch["target_pos"]`` to vocabulary logits."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.dense, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, vocab)

    def forward(self, states: torch.Tensor, batch: dict) -> torch.Tensor:
        pos = batch["target_pos"].long().clamp(min=0).unsqueeze(-1).expand(-1, -1, states.shape[-1])
        return self.out(torch.tanh(self.dense(torch.gather(states, 1, pos))))


class PerformerStandIn(Reports, nn.Module):
    """Their model's forward and training_step (weighted MLM + CLS cross-entropies) around their encoder's
    structure; hparams ``dropout`` (default 0: losses comparable between runs)."""

    def __init__(self, hparams: dict) -> None:
        super().__init__()
        self.global_step = 0
        self.hparams = hparams
        torch.manual_seed(hparams["seed"])
        size = replace(SIZES["tiny"], vocab=hparams["vocab_size"])
        self.transformer = TheirEncoder(size, dropout=hparams.get("dropout", 0.0))
        self.mlm_decoder = MaskedTokens(size.hidden, size.vocab)
        self.cls_decoder = nn.Linear(size.hidden, 3)
        self.mlm_loss = nn.CrossEntropyLoss(ignore_index=0)
        self.cls_loss = nn.CrossEntropyLoss(weight=torch.tensor(CLS_WEIGHTS), label_smoothing=0.1)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        states = self.transformer(x=batch["input_ids"].long(), padding_mask=batch["padding_mask"].long())
        return self.mlm_decoder(states, batch), self.cls_decoder(states[:, 0])

    def training_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mlm_preds, cls_preds = self(batch)
        mlm = self.mlm_loss(mlm_preds.permute(0, 2, 1), target=batch["target_tokens"].long())
        cls = self.cls_loss(cls_preds, target=batch["target_cls"].long())
        return 0.2 * cls + 0.8 * mlm, mlm, cls

    validation_step = training_step

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        return TinyEncoder.configure_optimizers(self)  # type: ignore[arg-type]


TransformerEncoder = PerformerStandIn if os.environ.get("PORT_MODEL") == "performer" else TinyStandIn
