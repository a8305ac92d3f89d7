"""lifeseq-shards: exact, DDP-ready shards and readers for life-event sequence pre-training."""

from .reader import DatasetChanged, ShardedDataset, ShardedLoader

__all__ = ["DatasetChanged", "LifeSeqDataModule", "ShardedDataset", "ShardedLoader"]


def __getattr__(name: str) -> object:
    # Lightning is imported only by those who use the DataModule.
    if name == "LifeSeqDataModule":
        from .datamodule import LifeSeqDataModule

        return LifeSeqDataModule
    raise AttributeError(name)
