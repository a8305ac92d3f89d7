"""Their ``read_hparams``, for a JSON file of hyper-parameters."""

from __future__ import annotations

import json


def read_hparams(path: str) -> dict:
    """The hyper-parameters in ``path`` (JSON)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
