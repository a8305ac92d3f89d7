"""lifeseq-shards' Lightning classes for code that imports ``pytorch_lightning`` (the researchers' ``pretrain.py``).

A ``pytorch_lightning`` Trainer accepts only ``pytorch_lightning`` classes, and ``lightning``'s are others: keep
your imports and take ours from here (``from lifeseq_shards.pl import LifeSeqDataModule, EmbeddingWriter``). The
behaviour is the same as ``lifeseq_shards.LifeSeqDataModule``'s: it lives in one place, these classes only add the
base.
"""

from __future__ import annotations

import pytorch_lightning as pl

from . import datamodule, model, signals
from .embed import writer as embed_writer


class LifeSeqDataModule(datamodule.LifeSeqDataHooks, pl.LightningDataModule):
    """A dataset's train / val / predict batches for a ``pytorch_lightning`` Trainer, resumable mid-epoch
    (:class:`~lifeseq_shards.datamodule.LifeSeqDataHooks` documents its arguments)."""


class LifeSeqPretrainModule(model.PretrainSteps, pl.LightningModule):
    """The reference encoder's MLM + CLS pre-training, validation and embeddings for a ``pytorch_lightning`` Trainer
    (:class:`~lifeseq_shards.model.PretrainSteps` documents its arguments)."""


class StopOnSigterm(signals.SigtermHooks, pl.Callback):
    """Ends a ``pytorch_lightning`` DDP fit on SIGTERM (scancel, a time limit) with exit status 143, without the hang
    of Lightning's own handler (:mod:`lifeseq_shards.signals` says why): ``Trainer(callbacks=[StopOnSigterm()])``."""


class EmbeddingWriter(embed_writer.EmbeddingWriterHooks, pl.callbacks.BasePredictionWriter):
    """Writes each person's embeddings from ``Trainer.predict`` into an output directory, for a
    ``pytorch_lightning`` Trainer (:class:`~lifeseq_shards.embed.writer.EmbeddingWriterHooks` documents it)."""


__all__ = ["EmbeddingWriter", "LifeSeqDataModule", "LifeSeqPretrainModule", "StopOnSigterm"]
