"""Embed a dataset with the reference model through ``trainer.predict`` and an EmbeddingWriter, as
docs/reference/ddp.md shows.

``--flavour pytorch_lightning`` takes everything from ``pytorch_lightning`` and ``lifeseq_shards.pl``; the default
``lightning``. ``--devices 2`` runs Lightning's ``ddp`` on CPU (gloo; this script is re-launched per rank).
``--delay`` sleeps after every batch, so that a test can kill the job while it is under way. The model's weights
come from a fixed seed: every run, with any number of ranks, embeds with the same model.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--flavour", default="lightning")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args()
    if args.flavour == "pytorch_lightning":
        import pytorch_lightning as pl

        from lifeseq_shards.pl import EmbeddingWriter, LifeSeqDataModule, LifeSeqPretrainModule
    else:
        import lightning.pytorch as pl

        from lifeseq_shards import EmbeddingWriter, LifeSeqDataModule
        from lifeseq_shards.model import LifeSeqPretrainModule
    from lifeseq_shards.model import EncoderConfig

    class Slow(pl.Callback):
        def on_predict_batch_end(self, *_args: object) -> None:
            time.sleep(args.delay)

    dm = LifeSeqDataModule(args.data, batch_size=args.batch_size, num_workers=args.workers)
    torch.manual_seed(0)
    model = LifeSeqPretrainModule(EncoderConfig(16, 32, 1, 2), dm.vocab_size, dropout=0.0)
    writer = EmbeddingWriter(args.out)  # fields from model.embedding_fields(), float32
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[writer, Slow()])
    trainer.predict(model, datamodule=dm, return_predictions=False)


if __name__ == "__main__":
    main()
