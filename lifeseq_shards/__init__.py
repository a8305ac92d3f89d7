"""lifeseq-shards: exact, DDP-ready shards and readers for life-event sequence pre-training.

The folders are its concerns, each one's ``__init__`` naming its modules: :mod:`.store` (the on-disk format),
:mod:`.convert` (``shardify convert`` and the dataset checks), :mod:`.plan` (the pure partition and resume
arithmetic), :mod:`.reader` (the DDP reader and its loader), :mod:`.device` (host batch -> device -> model batch),
:mod:`.embed` (embeddings of everyone). At the top: the front ends (:mod:`.datapath`, what both build;
:mod:`.datamodule` and :mod:`.pl` for Lightning, with :mod:`.lightning_loop`, its loop internals; :mod:`.loop` for a
plain loop; :mod:`.timing`, ``shardify time``), the reference model (:mod:`.encoder`, :mod:`.model`), the
researchers' performer encoder on packed batches (:mod:`.performer`), the MLM masks drawn on the device
(:mod:`.masking`, replayed as CUDA graphs by :mod:`.cudagraph`), the command line (:mod:`.cli`), and leaves every
part may use: :mod:`.compat` (what this torch and Lightning can do), :mod:`.deprecation` (old call forms that
warn), :mod:`.progress` (progress bars), :mod:`.schedule` (a restored OneCycleLR fitted to another arrangement) and
:mod:`.signals` (SIGTERM ends a DDP fit). docs/architecture.md says who may import whom.

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
