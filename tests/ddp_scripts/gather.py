"""Shared by the DDP worker scripts: collect one record per rank on rank 0 and write them as JSON for the test."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def gather_to_json(record: dict[str, Any], out: str | Path) -> None:
    """all_gather_object (a collective: every rank must call it), then rank 0 writes ``{"ranks": [...]}``.

    The file is written to a temp name and renamed, so a test never reads a half-written result.
    """
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        tmp = Path(f"{out}.tmp")
        tmp.write_text(json.dumps({"ranks": records}))
        tmp.replace(out)


def finish() -> None:
    """Every rank past its last collective, then the group down. torch 2.1's gloo can hang in the process group's
    destructor, joining its threads, even after the barrier (3 of 14 runs without it, 1 in a CI run with it): there
    the process ends without running destructors, its outputs already written and flushed."""
    dist.barrier()
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 3):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
