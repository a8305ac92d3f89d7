"""Write boundaries: an ``OSError`` while writing (a full disk, a file-size limit, a read-only or vanished
directory) becomes one line naming the path and the cause, which ``shardify`` prints with exit 2."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

# What a user can do about each cause: "free space" is no advice for a read-only or a missing directory
REMEDIES = {
    errno.ENOSPC: "free space, then run it again",
    errno.EDQUOT: "free space within your quota, then run it again",
    errno.EFBIG: "raise the file-size limit (ulimit -f), then run it again",
    errno.EROFS: "its file system is read-only: write to a writable directory",
    errno.EACCES: "you may not write there: write to a directory you may write to",
    errno.EPERM: "you may not write there: write to a directory you may write to",
    errno.ENOENT: "its directory does not exist: create it or name another",
}


class WriteFailed(OSError):
    """Writing ``path`` failed for ``cause``; ``kept`` says what the failure left, ``remedy`` what to do. Its
    message is one line. An ``OSError``, so that callers catching those still do."""

    def __init__(self, path: str | os.PathLike[str], cause: str, kept: str = "", remedy: str = "") -> None:
        self.path, self.cause, self.kept, self.remedy = str(path), cause, kept, remedy
        super().__init__(f"{path}: cannot write ({cause})" + "".join(f"; {x}" for x in (kept, remedy) if x))

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a converter process, re-raised in the parent
        return WriteFailed, (self.path, self.cause, self.kept, self.remedy)


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], kept: str = "") -> Iterator[None]:
    """Turn an ``OSError`` raised inside into :class:`WriteFailed` naming ``path`` and the cause, saying what was
    ``kept`` and what to do about that cause (:data:`REMEDIES`). An inner boundary's WriteFailed keeps its path (the
    file that failed) and gets ``kept`` if it said nothing of it (the outer boundary knows what the whole operation
    leaves)."""
    try:
        yield
    except WriteFailed as e:
        if e.kept or not kept:
            raise
        raise WriteFailed(e.path, e.cause, kept, e.remedy) from e.__cause__
    except OSError as e:
        raise WriteFailed(path, cause(e), kept, remedy(e)) from e


def discard(tmp: str | os.PathLike[str]) -> None:
    """Remove a temp file if one was made. Not ``unlink(missing_ok=True)``: on a read-only filesystem that raises
    EROFS for a file that is not there, and the traceback would hide the write's own one-line error."""
    if os.path.lexists(tmp):
        os.unlink(tmp)


def remedy(e: OSError) -> str:
    """What to do about ``e``'s cause; pyarrow's errors carry their errno only in their text."""
    code = e.errno or next((c for c in REMEDIES if os.strerror(c) in str(e)), 0)
    return REMEDIES.get(code, "fix that, then run it again")


def cause(e: OSError) -> str:
    """The reason in a few words: the errno's text (``No space left on device``, ``File too large``) or, from
    pyarrow, which rarely sets ``strerror``, its message on one line."""
    if e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return " ".join(str(e).split()) or type(e).__name__
