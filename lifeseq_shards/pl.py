"""lifeseq-shards' Lightning classes for code that imports ``pytorch_lightning`` (the researchers' ``pretrain.py``).

A ``pytorch_lightning`` Trainer accepts only ``pytorch_lightning`` classes, and ``lightning``'s are others: keep
your imports and take ours from here (``from lifeseq_shards.pl import LifeSeqDataModule, EmbeddingWriter``). The
behaviour is the same as ``lifeseq_shards.LifeSeqDataModule``'s: it lives in one place, these classes only add the
base.
"""

from __future__ import annotations

import pytorch_lightning as pl

from .datamodule import LifeSeqDataHooks
from .embed_writer import EmbeddingWriterHooks
from .model import PretrainSteps
from .signals import SigtermHooks


class LifeSeqDataModule(LifeSeqDataHooks, pl.LightningDataModule):
    """:class:`~lifeseq_shards.datamodule.LifeSeqDataHooks` for a ``pytorch_lightning`` Trainer."""


class LifeSeqPretrainModule(PretrainSteps, pl.LightningModule):
    """:class:`~lifeseq_shards.model.PretrainSteps` for a ``pytorch_lightning`` Trainer."""


class StopOnSigterm(SigtermHooks, pl.Callback):
    """:class:`~lifeseq_shards.signals.SigtermHooks` for a ``pytorch_lightning`` Trainer."""


class EmbeddingWriter(EmbeddingWriterHooks, pl.callbacks.BasePredictionWriter):
    """:class:`~lifeseq_shards.embed_writer.EmbeddingWriterHooks` for a ``pytorch_lightning`` Trainer."""


__all__ = ["EmbeddingWriter", "LifeSeqDataModule", "LifeSeqPretrainModule", "StopOnSigterm"]
