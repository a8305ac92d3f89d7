"""Write boundaries: an ``OSError`` while writing (a full disk, a file-size limit, a read-only or vanished
directory) becomes one line naming the path and the cause, which ``shardify`` prints with exit 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


class WriteFailed(OSError):
    """Writing ``path`` failed for ``cause``; ``kept`` says what the failure left. Its message is one line. An
    ``OSError``, so that callers catching those still do."""

    def __init__(self, path: str | os.PathLike[str], cause: str, kept: str = "") -> None:
        self.path, self.cause, self.kept = str(path), cause, kept
        super().__init__(f"{path}: cannot write ({cause})" + (f"; {kept}" if kept else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a converter process, re-raised in the parent
        return WriteFailed, (self.path, self.cause, self.kept)


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], kept: str = "") -> Iterator[None]:
    """Turn an ``OSError`` raised inside into :class:`WriteFailed` naming ``path`` and the cause, and saying what
    was ``kept``. An inner boundary's WriteFailed keeps its path (the file that failed) and gets ``kept`` if it
    said nothing of it (the outer boundary knows what the whole operation leaves)."""
    try:
        yield
    except WriteFailed as e:
        if e.kept or not kept:
            raise
        raise WriteFailed(e.path, e.cause, kept) from e.__cause__
    except OSError as e:
        raise WriteFailed(path, cause(e), kept) from e


def cause(e: OSError) -> str:
    """The reason in a few words: the errno's text (``No space left on device``, ``File too large``) or, from
    pyarrow, which rarely sets ``strerror``, its message on one line."""
    if e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return " ".join(str(e).split()) or type(e).__name__
