"""Write boundaries: an ``OSError`` while writing (a full disk, a file-size limit, a read-only or vanished
directory) becomes one line naming the path and the cause, which ``shardify`` prints with exit 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class WriteFailed(OSError):
    """Writing ``path`` failed; the message is one line: the path, the cause and what was kept. An ``OSError``, so
    that callers catching those still do."""


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], kept: str) -> Iterator[None]:
    """Turn an ``OSError`` raised inside into :class:`WriteFailed` naming ``path`` and the cause; ``kept`` says what
    the failure left (e.g. "nothing of it is kept"). One already turned (an inner boundary's) passes unchanged."""
    try:
        yield
    except WriteFailed:
        raise
    except OSError as e:
        raise WriteFailed(f"{path}: cannot write ({cause(e)}); {kept}") from e


def cause(e: OSError) -> str:
    """The reason in a few words: the errno's text (``No space left on device``, ``File too large``) or, from
    pyarrow, which rarely sets ``strerror``, its message."""
    if e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return " ".join(str(e).split()) or type(e).__name__
