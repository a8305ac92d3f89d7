"""Train a tiny model for one epoch with LifeSeqDataModule under Lightning DDP on CPU; rank 0 writes, per rank, the
person ids of every training and validation batch, the loader lengths and the seed batch's shape (tiny_model.py).

``--predict`` runs ``trainer.predict`` instead (rank 0 writes every rank's predicted person ids). ``--ckpt-every K``
saves a checkpoint every K steps (mid-epoch, through ModelCheckpoint); ``--resume CKPT`` continues the fit from one;
``--no-val`` skips validation. ``ddp`` re-launches this script per rank; ``ddp_spawn`` spawns the
ranks, and their DataLoader workers are spawned too and re-import this file (not running main): Lightning is imported
inside main() so that those workers start in about a second instead of importing it each."""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches-per-message", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-dir")
    p.add_argument("--resume")
    p.add_argument("--no-val", action="store_true")
    p.add_argument("--predict", action="store_true", help="run trainer.predict (every person once) instead of fit")
    args = p.parse_args()

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tiny_model import Tiny

    from lifeseq_shards.datamodule import LifeSeqDataModule

    callbacks = []
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.ckpt_every,
                                         save_top_k=-1, save_on_train_epoch_end=False))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=1, logger=False,
                        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0 if args.no_val else None)
    dm = LifeSeqDataModule(args.data, batch_size=args.batch_size, num_workers=args.workers,
                           batches_per_message=args.batches_per_message)
    if args.predict:
        trainer.predict(Tiny(args.out), datamodule=dm, return_predictions=False)
    else:
        trainer.fit(Tiny(args.out), datamodule=dm, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
