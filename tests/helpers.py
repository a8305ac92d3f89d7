"""Small helpers the test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], bool], seconds: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``seconds`` pass (False): a process's effect, with a hard bound."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True
