"""Shared by the DDP worker scripts: collect one record per rank on rank 0 and write them as JSON for the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
