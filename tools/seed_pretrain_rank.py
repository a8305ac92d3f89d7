"""One rank of tools/seed_pretrain_check.py: the researchers' own ``pretrain.py`` (patched by docs/seed-pretrain.diff)
run as their ``__main__``, or the predict lines of docs/reference/ddp.md with their ``TransformerEncoder``. Launched by
torchrun
with their repository and its dependencies on PYTHONPATH; not for use on its own.

    fit CONFIG RECORDS EVERY -- THEIR_ARGS...   their pretrain.py with THEIR_ARGS (its argparse), plus two callbacks
    predict CONFIG CHECKPOINT EMB DATA          the docs' predict snippet, on the CPU, ddp over torchrun's ranks

What ``fit`` adds to their run, and why (nothing in their files changes):
- ``seed_everything(0)`` before their script: it seeds nothing that Lightning calls (their ``train_epoch_start`` is
  not a Lightning hook), and an uninterrupted run and a killed one must start from the same weights to compare them;
- a ``ModelCheckpoint(every_n_train_steps=EVERY)`` beside their own (which saves after each validation): a
  checkpoint saved inside an epoch at a batch's end, as a requeued job's is;
- a recorder: per rank and optimizer step, the person ids of the batch, its loss and learning rate
  (``RECORDS/rank<R>.jsonl``, one line per step, flushed), and the weights at the end of the last epoch (rank 0,
  ``RECORDS/final.pt``, taken before their ``on_train_epoch_end`` redraws the performer's projections from the
  unseeded global RNG, which no checkpoint holds).
Both go into the Trainer their ``pretrain()`` builds, through the ``Trainer`` name their script imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint


class Recorder(pl.Callback):
    """Per step: the batch's person ids, loss and learning rate; at the last epoch's end the weights."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.file = open(self.out / f"rank{trainer.global_rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        line = {"epoch": trainer.current_epoch, "step": trainer.global_step, "batch": batch_idx,
                "ids": batch["person_id"].tolist(), "loss": float(loss).hex(),
                "lr": trainer.optimizers[0].param_groups[0]["lr"].hex()}
        self.file.write(json.dumps(line) + "\n")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0 and trainer.current_epoch == trainer.max_epochs - 1:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / "final.pt")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.file.close()


def fit(config: str, records: str, every: int, their_args: list[str]) -> None:
    extra = [ModelCheckpoint(dirpath=Path(json.loads(Path(config).read_text())["CHECKPOINT_DIR"]) / "steps",
                             filename="step-{step}", every_n_train_steps=every, save_top_k=-1),
             Recorder(Path(records))]

    class Trainer(pl.Trainer):
        def __init__(self, *args: Any, callbacks: list[Any] | None = None, **kw: Any) -> None:
            super().__init__(*args, callbacks=[*(callbacks or []), *extra], **kw)

    pl.Trainer = Trainer  # type: ignore[misc]  # their `from pytorch_lightning import Trainer` takes this one
    pl.seed_everything(0)
    script = importlib.util.find_spec("pop2vec.llm.src.new_code.pretrain").origin
    sys.argv = [script, *their_args, "--config", config]
    runpy.run_path(script, run_name="__main__")


def predict(config: str, checkpoint: str, emb: str, data: str) -> None:
    """docs/reference/ddp.md's predict lines ("predict (models.py)"), with accelerator="cpu" and torchrun's rank
    count."""
    from pop2vec.llm.src.new_code.utils import read_hparams, read_json
    from pop2vec.llm.src.transformer.models import TransformerEncoder

    from lifeseq_shards.pl import EmbeddingWriter, LifeSeqDataModule

    cfg = read_json(config)
    model = TransformerEncoder.load_from_checkpoint(checkpoint, hparams=read_hparams(cfg["HPARAMS_PATH"]))
    # as converted (--workers 2): guides/tune-gpu.md; padded to their max_length, or packed as the model trained
    padded = model.packed_encoder() is None
    dm = LifeSeqDataModule(data, batch_size=512, num_workers=2, layout="padded" if padded else "packed",
                           pad_to=model.hparams["max_length"] if padded else None)
    width = model.hparams["hidden_size"]
    writer = EmbeddingWriter(emb, fields={"cls_emb": width, "mean_emb": width}, dtype="float16", id_key="sequence_id",
                             padding=model.embedding_padding())
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp", logger=False,
                         callbacks=[writer])
    trainer.predict(model, datamodule=dm, return_predictions=False)


def main() -> None:
    role, *rest = sys.argv[1:]
    if role == "fit":
        config, records, every, dashes, *their_args = rest
        assert dashes == "--", "fit CONFIG RECORDS EVERY -- THEIR_ARGS..."
        fit(config, records, int(every), their_args)
    elif role == "predict":
        predict(*rest)
    else:
        raise SystemExit(f"unknown role {role!r}: fit or predict")


if __name__ == "__main__":
    main()
