"""The DDP reader: a webdataset pipeline whose node/worker split comes from the pure plan, not from the environment.

One concern per module: :mod:`.dataset` (configuration, plan queries, epoch control, ``__iter__``), :mod:`.stages`
(the pipeline's generators), :mod:`.collate` (persons -> a batch, under a frozen :class:`BatchSpec`),
:mod:`.transport` (the workers' shared-memory rings and process context), :mod:`.launch` (rank and world size
from the launcher's variables) and :mod:`.loader` (:class:`ShardedLoader` and its checkpoint state).
docs/architecture.md shows how the data flows between them.
"""

from __future__ import annotations

from ..deprecation import module_aliases
from ..plan import BALANCED, COMPLETE, EXACT, Segment
from .collate import BatchSpec, collate, collate_packed, collate_padded
from .dataset import MAX_WORKERS, EpochControl, ShardedDataset
from .launch import LAUNCHER_VARS, LaunchError, default_rank_world
from .loader import (
    MAX_PREFETCH,
    PIPE_MESSAGE_PERSONS,
    RING_MESSAGE_PERSONS,
    RING_PERSON_BYTES,
    SHM_DIR,
    DatasetChanged,
    ShardedLoader,
)
from .stages import batches, load_windows, messages, read_piece, read_segment, slot_windows
from .transport import PIPE_BYTES, RingReader, RingSlot, RingWriter, WorkerLink

__all__ = [
    "BALANCED", "COMPLETE", "EXACT", "LAUNCHER_VARS", "MAX_PREFETCH", "MAX_WORKERS", "PIPE_BYTES",
    "PIPE_MESSAGE_PERSONS",
    "RING_MESSAGE_PERSONS", "RING_PERSON_BYTES", "SHM_DIR", "BatchSpec", "DatasetChanged", "EpochControl",
    "LaunchError", "RingReader", "RingSlot", "RingWriter", "Segment", "ShardedDataset", "ShardedLoader", "WorkerLink",
    "batches", "collate", "collate_packed", "collate_padded", "default_rank_world", "load_windows", "messages",
    "read_piece", "read_segment", "slot_windows",
]

__getattr__ = module_aliases(__name__, {"TRAIN": "lifeseq_shards.plan:BALANCED",
                                        "INFERENCE": "lifeseq_shards.plan:COMPLETE",
                                        "Piece": "lifeseq_shards.plan:Segment"})
