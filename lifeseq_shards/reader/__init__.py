"""The DDP reader: a webdataset pipeline whose node/worker split comes from the pure plan, not from the environment.

One concern per module: :mod:`.options` (the dataset's arguments as one frozen value), :mod:`.dataset`
(configuration from the manifest, plan queries, ``__iter__``), :mod:`.control` (the epoch and resume point of the
next pass, where persistent workers see it), :mod:`.stages` (the pipeline's
generators), :mod:`.collate` (persons -> a batch, under a frozen :class:`BatchSpec`), :mod:`.transport` (the
workers' shared-memory rings and process context), :mod:`.launch` (rank and world size from the launcher's
variables), :mod:`.mainguard` (a script that starts workers outside ``if __name__ == "__main__":`` told what to do,
before any worker starts), :mod:`.loader` (:class:`ShardedLoader` and its checkpoint state), :mod:`.state` (that
state's format, read and written there only) and :mod:`.rest` (the rest of a checkpoint's epoch in another arrangement,
as ``shardify plan --resume`` shows it).
docs/architecture.md shows how the data flows between them.

The public names are what training code, the tools and the tests use: the dataset and its loader, the error a resume
into another dataset raises, this process's rank of the world (:class:`World`, from the launcher by default, and
the error when the launcher's variables do not say), a block's persons as a batch (:class:`BatchSpec`,
:func:`collate`) and one shard's persons read (:func:`read_segment`). Everything else is imported from the module
that defines it.
"""

from __future__ import annotations

from .collate import BatchSpec, collate
from .dataset import ShardedDataset
from .launch import LaunchError, World
from .loader import DatasetChanged, ShardedLoader
from .stages import read_segment

__all__ = ["BatchSpec", "DatasetChanged", "LaunchError", "ShardedDataset", "ShardedLoader", "World", "collate",
           "read_segment"]
