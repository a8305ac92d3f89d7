"""The data path of the researchers' plain-PyTorch loop (pytorch_port/pretrain.py) as docs/port-pretrain.diff leaves
it, around a tiny model with their model's interface, run under torchrun (the diff's DDP wrapper, early stop and
schedule refit run on their own file, in tests/test_port_pretrain.py): LifeSeqData for the batches, set_epoch each
epoch, validation every ``--val-every`` batches with a checkpoint saved by rank 0 (their Checkpointer's layout plus
``"data"``), DeviceMetrics for the losses, resume from ``--resume CKPT``.

Each rank appends a line per training batch to ``OUT/rank<r>.jsonl`` as it trains (epoch, batch index, person ids,
a digest of the masked input and targets), so a run killed with SIGKILL leaves what it trained. ``--pause-at STEP``
stops after that global step (writes ``OUT/paused-<r>``, then waits to be killed). tests/test_plain_loop.py runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from gather import finish
from torch import nn

from lifeseq_shards import DeviceMetrics, LifeSeqData
from lifeseq_shards.masking import MaskingConfig

TOKEN_IDS = 2**16


class TransformerEncoder(nn.Module):
    """Their model's interface (training_step / validation_step -> loss, mlm, cls; global_step; their AdamW +
    OneCycleLR from hparams["steps_per_epoch"]), tiny."""

    def __init__(self, hparams: dict) -> None:
        super().__init__()
        self.global_step = 0
        self.hparams = hparams
        torch.manual_seed(hparams["seed"])
        self.embedding = nn.Embedding(TOKEN_IDS, 4)
        self.mlm_decoder = nn.Linear(4, 8)
        self.cls_decoder = nn.Linear(4, 3)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        states = torch.tanh(self.embedding(batch["input_ids"][:, 0].long()))
        states = states * batch["padding_mask"].unsqueeze(-1)
        picked = torch.gather(states, 1, batch["target_pos"].clamp(min=0).unsqueeze(-1).expand(-1, -1, 4))
        return self.mlm_decoder(picked), self.cls_decoder(states[:, 0])

    def training_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mlm_preds, cls_preds = self(batch)
        mlm = nn.functional.cross_entropy(mlm_preds.permute(0, 2, 1), batch["target_tokens"].long() % 8,
                                          ignore_index=0)
        cls = nn.functional.cross_entropy(cls_preds, batch["target_cls"].long())
        return 0.2 * cls + 0.8 * mlm, mlm, cls

    validation_step = training_step

    def on_train_epoch_end(self) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        pass

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["learning_rate"], betas=(0.9, 0.999))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams["learning_rate"], epochs=self.hparams["epochs"],
            steps_per_epoch=self.hparams["steps_per_epoch"], pct_start=0.05, three_phase=False, div_factor=30)
        return optimizer, scheduler


class Checkpointer:
    """Their Checkpointer's save (one file per save, last.ckpt copied), with the data position."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)

    def maybe_save(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, epoch: int,
                   step: int, loss: float, hparams: dict, data_state: dict) -> None:
        path = self._dir / f"model-{epoch:02d}-{step}-{loss:.2f}.ckpt"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,  # type: ignore[attr-defined]
                    "val_loss_track": loss, "hparams": hparams, "data": data_state}, path)
        shutil.copy(path, self._dir / "last.ckpt")


def digest(batch: dict) -> str:
    """The masked input and the targets of a batch: equal digests, equal masks."""
    h = hashlib.sha1()
    for key in ("input_ids", "target_pos", "target_tokens", "target_cls"):
        h.update(batch[key].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def validation_epoch(model: TransformerEncoder, data: LifeSeqData, device: torch.device) -> float:
    model.eval()
    metrics = DeviceMetrics(("loss", "mlm", "cls"), device)
    for batch in data.val():
        with torch.no_grad():
            loss, mlm, cls = model.validation_step(batch)
        metrics.add(loss=loss, mlm=mlm, cls=cls)
    return metrics.compute()["loss"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--resume")
    p.add_argument("--pause-at", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hparams = {"seed": 0, "learning_rate": 1e-3, "epochs": args.epochs}
    data = LifeSeqData(args.data, batch_size=args.batch_size, num_workers=args.workers, masking=MaskingConfig(),
                       pad_to=512, device=device, prefetch=True)  # the batch built ahead, as on CUDA
    hparams["steps_per_epoch"] = len(data.train())
    model = TransformerEncoder(hparams).to(device)
    optimizer, scheduler = model.configure_optimizers()
    ckptr = Checkpointer(out / "ckpt")

    start_epoch, global_step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        model.global_step = global_step = ckpt["step"]
        data.load_state_dict(ckpt["data"])
        start_epoch = data.epoch

    log = (out / f"rank{rank}.jsonl").open("a")
    for epoch in range(start_epoch, args.epochs):
        data.set_epoch(epoch)
        model.train()
        metrics = DeviceMetrics(("loss", "mlm", "cls"), device)
        done = data.resumed_batches
        for b_idx, batch in enumerate(data.train(), start=done + 1):
            optimizer.zero_grad(set_to_none=True)
            loss, mlm, cls = model.training_step(batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
            model.global_step += 1
            global_step = model.global_step
            metrics.add(loss=loss, mlm=mlm, cls=cls)
            log.write(json.dumps({"epoch": epoch, "batch": b_idx, "ids": batch["person_id"].tolist(),
                                  "digest": digest(batch)}) + "\n")
            log.flush()
            if args.val_every and b_idx % args.val_every == 0:
                v_c = validation_epoch(model, data, device)
                model.train()
                if rank == 0:
                    ckptr.maybe_save(model, optimizer, scheduler, epoch, global_step, v_c, hparams,
                                     data.state_dict())
            if global_step == args.pause_at:
                (out / f"paused-{rank}").write_text(str(os.getpid()))
                while True:  # until the test kills the job, as a preemption would
                    time.sleep(1)
        metrics.compute()
        v_c = validation_epoch(model, data, device)
        if rank == 0:
            ckptr.maybe_save(model, optimizer, scheduler, epoch, global_step, v_c, hparams, data.state_dict())
    log.close()
    finish()


if __name__ == "__main__":
    main()
