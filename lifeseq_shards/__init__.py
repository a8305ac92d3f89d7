"""lifeseq-shards: exact, DDP-ready shards and readers for life-event sequence pre-training.

The public classes load on first use (PEP 562), so that ``shardify`` and the converter start without torch,
webdataset or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .datamodule import LifeSeqDataModule
    from .embed.writer import EmbeddingWriter
    from .loop import DeviceMetrics, LifeSeqData
    from .reader import DatasetChanged, ShardedDataset, ShardedLoader

# public name -> the submodule that defines it
_LAZY = {
    "DatasetChanged": "reader",
    "EmbeddingWriter": "embed.writer",
    "DeviceMetrics": "loop",
    "LifeSeqData": "loop",
    "LifeSeqDataModule": "datamodule",
    "ShardedDataset": "reader",
    "ShardedLoader": "reader",
}

__all__ = ["DatasetChanged", "DeviceMetrics", "EmbeddingWriter", "LifeSeqData", "LifeSeqDataModule", "ShardedDataset",
           "ShardedLoader"]  # = _LAZY's keys


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
