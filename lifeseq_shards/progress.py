"""The progress bars of every long command, in one place: tqdm's bar on a terminal; into a file (a SLURM log, a
pipe) plain lines at most every :data:`LOG_INTERVAL` seconds, since a bar redrawn with ``\\r`` becomes one endless
line there."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL = 30.0  # seconds between lines in a log file: a conversion of tens of minutes writes tens of lines


class _Lines:
    """A text stream that writes each of tqdm's redraws as a line of its own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Iterable[Any] | None = None, *, file: TextIO | None = None, **kw: Any) -> tqdm:
    """``tqdm(iterable, **kw)`` writing to ``file`` (default stderr): a bar on a terminal, else plain lines at most
    every :data:`LOG_INTERVAL` seconds (``mininterval`` in ``kw`` overrides it)."""
    stream = sys.stderr if file is None else file
    if stream.isatty():
        return tqdm(iterable, file=stream, **kw)
    return tqdm(iterable, file=_Lines(stream), **{"mininterval": LOG_INTERVAL, "ascii": True, "ncols": 100, **kw})
