"""Integers reach the shards unchanged or are refused: a cast must never round, wrap or invent a value."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import SourceError

INT64_MAX = np.iinfo(np.int64).max
FLOAT_EXACT = 2**53  # beyond it a float64 skips integers, so an integral float may already be a rounded id


def exact_int64(values: np.ndarray, name: str, where: Callable[[int], str]) -> np.ndarray:
    """Numeric ``values`` (any shape) as int64, or a SourceError at the first one int64 cannot hold exactly: a float
    with a fraction, NaN, or beyond 2^53, or a uint64 beyond 2^63 - 1. ``where(i)`` names flat position ``i``
    (file and row). pandas makes an id column float when a value is missing: 12.0 is kept as 12, NaN refused."""
    kind = values.dtype.kind
    if kind in "ib":
        return values.astype(np.int64, copy=False)
    if kind == "u":
        bad = values > INT64_MAX
    else:
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(values) <= FLOAT_EXACT) | (values != np.floor(values))  # NaN fails the first test
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SourceError(f"{where(i)}: {name} {values.flat[i].item()!r} is not an integer that int64 holds exactly")
    return values.astype(np.int64)
