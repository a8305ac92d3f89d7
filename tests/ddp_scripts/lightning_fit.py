"""Train the researcher-style model of tiny_model.py with LifeSeqDataModule under Lightning DDP on CPU; rank 0 writes,
per rank, the person ids of every training batch (per epoch) and validation batch, the loader lengths and the seed
batch's shape.

``--flavour pytorch_lightning`` runs it all with ``import pytorch_lightning`` (the researchers' imports, and
``lifeseq_shards.pl``'s DataModule), the default with ``import lightning``. ``--predict`` runs ``trainer.predict``
instead (rank 0 writes every rank's predicted person ids and token fingerprints). ``--ckpt-every K`` saves a
checkpoint every K steps (mid-epoch), one at each epoch's end and one after each validation (as the seed's
``pretrain.py`` does); ``--save-mid-step STEP PATH`` saves one inside training step STEP (as Lightning's SLURM
requeue handler does); ``--resume CKPT`` continues the fit from one.
``ddp`` re-launches this script per rank; ``ddp_spawn`` spawns the ranks, and their DataLoader workers re-import this
file (not running main): Lightning is imported inside main() so that those workers start in about a second instead
of importing it each."""

from __future__ import annotations

import argparse
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--flavour", choices=("lightning", "pytorch_lightning"), default="lightning")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--devices", type=int, default=2, help="ranks (CPU processes)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-persistent", action="store_true", help="persistent_workers=False")
    p.add_argument("--batches-per-message", type=int, default=None)
    p.add_argument("--tokens-per-batch", type=int, default=None, help="training batches by a token budget")
    p.add_argument("--masking", choices=("none", "dynamic"), default="none")
    p.add_argument("--prefetch", action="store_true", help="build the next batch during the step (CUDA's default)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-dir")
    p.add_argument("--resume")
    p.add_argument("--no-val", action="store_true")
    p.add_argument("--no-sanity", action="store_true", help="num_sanity_val_steps=0")
    p.add_argument("--val-check-interval", type=float, default=1.0)
    p.add_argument("--limit-train", type=int, default=None, help="limit_train_batches")
    p.add_argument("--limit-val", type=int, default=None, help="limit_val_batches")
    p.add_argument("--stop-on-sigterm", action="store_true", help="add StopOnSigterm (a SIGTERM ends it, status 143)")
    p.add_argument("--predict", action="store_true", help="run trainer.predict (every person once) instead of fit")
    p.add_argument("--save-mid-step", nargs=2, metavar=("STEP", "PATH"),
                   help="save a checkpoint inside training step STEP (as SLURM's auto-requeue signal does)")
    args = p.parse_args()

    os.environ["LIFESEQ_FLAVOUR"] = args.flavour  # read by tiny_model, in this process and in the ranks it starts
    if args.flavour == "pytorch_lightning":
        import pytorch_lightning as pl

        from lifeseq_shards.pl import LifeSeqDataModule, StopOnSigterm
    else:
        import lightning.pytorch as pl

        from lifeseq_shards import LifeSeqDataModule
        from lifeseq_shards.signals import StopOnSigterm
    from tiny_model import Tiny

    from lifeseq_shards.masking import MaskingConfig

    callbacks = []
    if args.ckpt_every:
        callbacks += [pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                                   every_n_train_steps=args.ckpt_every, save_on_train_epoch_end=False),
                      pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="end-{epoch}", save_top_k=-1,
                                                   every_n_epochs=1, save_on_train_epoch_end=True)]
        if not args.no_val:  # as the seed's pretrain.py: after each validation (mid-epoch with val_check_interval)
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="val-{step}",
                                                          monitor="val_loss_track", save_top_k=-1))
    if args.stop_on_sigterm:
        callbacks.append(StopOnSigterm())
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=bool(args.ckpt_every), callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0 if args.no_val else args.limit_val, limit_train_batches=args.limit_train,
                         num_sanity_val_steps=0 if args.no_sanity else None, val_check_interval=args.val_check_interval)
    dm = LifeSeqDataModule(args.data, batch_size=args.batch_size, num_workers=args.workers,
                           persistent_workers=not args.no_persistent, batches_per_message=args.batches_per_message,
                           masking=MaskingConfig() if args.masking == "dynamic" else None, prefetch=args.prefetch,
                           tokens_per_batch=args.tokens_per_batch)
    if args.predict:
        trainer.predict(Tiny(args.out), datamodule=dm, return_predictions=False)
    else:
        model = Tiny(args.out, (int(args.save_mid_step[0]), args.save_mid_step[1]) if args.save_mid_step else None)
        trainer.fit(model, datamodule=dm, ckpt_path=args.resume)
    import torch.distributed as dist

    # Lightning leaves the group up: torn down here, not by the exit (gloo's threads). Not after an interrupt
    # (Lightning 2.2 returns from a fit Ctrl-C stopped): a peer may still be inside a collective; a barrier would hang
    if dist.is_initialized() and not trainer.interrupted:
        from gather import finish

        finish()


if __name__ == "__main__":
    main()
