"""The converter's output directory: one conversion at a time (a lock), the new dataset built aside (staging), and
an old dataset replaced only once the new one is complete, deleting nothing but the files its manifest lists."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from ..store.manifest import MANIFEST
from ..store.writes import WriteFailed, cause, remedy

# ours in a dataset directory: the lock held while a conversion runs; the directory a new dataset is built in; the
# mark present while old files are replaced by new ones (it holds the old manifest, so a rerun knows what to clear);
# the parts of an array conversion's tasks, until they are merged (array.py)
LOCK, STAGING, INCOMPLETE = ".conversion.lock", ".conversion-staging", ".conversion-incomplete"
TASKS = ".conversion-tasks"
OURS = (LOCK, STAGING, INCOMPLETE, TASKS)


class ConvertError(ValueError):
    """Bad input or a refused output directory; the message is one line."""


@contextlib.contextmanager
def output_dir(out: Path, overwrite: bool) -> Iterator[list[str]]:
    """Hold ``out``'s lock for the whole conversion (a second one refuses before touching anything), clear what a
    killed conversion left, and yield the files the old dataset's manifest lists (what --overwrite replaces). A
    directory this call created is removed again when the conversion fails (an empty one looks like a dataset)."""
    refuse_foreign(out, overwrite)  # before creating the lock file: a refused directory is left as it was
    created, done = not out.exists(), False
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        lock = out / LOCK
        if lock.exists() and not lock.is_file():  # a directory (or a link loop) in the lock's place
            raise ConvertError(f"{lock}: cannot open the conversion lock ({e.strerror}); it should be a plain "
                               "file: remove it if no conversion is running") from None
        # a read-only, forbidden or full place: what to do about that cause
        raise WriteFailed(out, cause(e), "nothing converted", remedy(e)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConvertError(f"{out}: another conversion is writing to it ({LOCK} is locked)") from None
        refuse_foreign(out, overwrite)  # again under the lock: the other conversion may have finished meanwhile
        _clear_unfinished(out)
        yield _listed_files(out / MANIFEST) if (out / MANIFEST).exists() else []
        done = True
    finally:
        if created and not done:  # unlinked while still held: a second conversion into it was refused at the lock
            (out / LOCK).unlink(missing_ok=True)
        os.close(fd)  # releases the lock; the empty lock file stays (removing it would let two lock two files)
        if created and not done:
            with contextlib.suppress(OSError):  # something else was put in it meanwhile: left as it is
                out.rmdir()


def replace_dataset(out: Path, staging: Path, old: list[str], new: list[str]) -> None:
    """Move the complete new dataset from ``staging`` into ``out``. The new files bound for another filesystem (a
    split directory that is a symlink to scratch space) are first copied beside their place, where a rename can
    reach it; then the old manifest becomes the INCOMPLETE mark (from here the directory is no dataset, and a rerun
    knows the old files), the old files go, the new ones move in, the new manifest last. Nothing else in ``out`` is
    touched; a file in the way that is not the old dataset's, or a copy that fails (a full scratch disk), stops it
    before anything is deleted."""
    keep = set(old)
    clash = [f for f in new if f not in keep and (out / f).exists()]
    if clash:
        raise ConvertError(f"{out / clash[0]}: exists and is not the old dataset's; move it away")
    sources = _near_sources(out, staging, new)
    if (out / MANIFEST).exists():
        os.replace(out / MANIFEST, out / INCOMPLETE)
    else:
        (out / INCOMPLETE).touch()
    for f in old:
        (out / f).unlink(missing_ok=True)
    for f, src in zip(new, sources, strict=True):
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, out / f)
    os.replace(staging / MANIFEST, out / MANIFEST)
    (out / INCOMPLETE).unlink()
    shutil.rmtree(staging)
    _remove_near_staging(out)
    for d in sorted({(out / f).parent for f in old} - {(out / f).parent for f in new}):
        with contextlib.suppress(OSError):  # an old split directory the new dataset lacks, unless it holds user files
            d.rmdir()


def _near_sources(out: Path, staging: Path, new: list[str]) -> list[Path]:
    """Where each new file moves in from: its place in ``staging``, or, when its directory in ``out`` is on another
    filesystem (where os.replace fails with EXDEV), a copy in that directory's own STAGING directory."""
    staging_dev = os.stat(staging).st_dev
    sources = []
    try:
        for f in new:
            near = next(p for p in (out / f).parents if p.exists())
            if os.stat(near).st_dev == staging_dev:
                sources.append(staging / f)
                continue
            copy = near / STAGING / (out / f).relative_to(near)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(staging / f, copy)
            sources.append(copy)
    except OSError as e:
        _remove_near_staging(out)
        raise ConvertError(f"{out / f}: cannot copy the new shard onto its filesystem ({e.strerror or e}); the old "
                           "dataset is kept") from None
    return sources


def _remove_near_staging(out: Path) -> None:
    """The copies :func:`_near_sources` made inside split directories (of a finished or a killed conversion)."""
    for d in out.glob(f"*/{STAGING}"):
        shutil.rmtree(d, ignore_errors=True)


def refuse_foreign(out: Path, overwrite: bool) -> None:
    """Refuse a finished dataset (unless overwrite) or a non-empty directory that is not ours (read-only checks)."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    if (out / MANIFEST).exists():
        if not overwrite:
            raise ConvertError(f"{out}: already holds a dataset (manifest.json); pass --overwrite to replace it")
    elif out.exists() and not (out / INCOMPLETE).exists() and any(p.name not in OURS for p in out.iterdir()):
        raise ConvertError(f"{out}: exists, is not empty and is not a dataset; choose an empty or new directory")


def _clear_unfinished(out: Path) -> None:
    """Remove what a killed conversion left: its staging directory and, if it was killed while replacing files,
    the files the old and the new manifest list (both ours; a user's own files are in neither)."""
    mark = out / INCOMPLETE
    if mark.exists():
        if not (out / MANIFEST).exists():  # killed between moving the old manifest aside and placing the new one
            for listing in (mark, out / STAGING / MANIFEST):
                for f in _listed_files(listing) if listing.exists() else []:
                    (out / f).unlink(missing_ok=True)
        mark.unlink()
    shutil.rmtree(out / STAGING, ignore_errors=True)
    _remove_near_staging(out)


def _listed_files(manifest: Path) -> list[str]:
    """The files a manifest lists (shards, lengths indexes), relative to its directory: all that replacing its dataset
    may delete.

    Read from the raw JSON, not with ``parse_manifest``: an old, empty (the INCOMPLETE mark) or damaged manifest
    still names the files to replace, and a path that leaves the dataset must be refused here, not skipped."""
    try:
        text = manifest.read_text()
        splits = json.loads(text)["splits"].values() if text.strip() else []
        files = [e["file"] for s in splits for e in [*s["shards"], *([s["remainder"]] if s["remainder"] else []),
                                                     *([s["lengths"]] if s.get("lengths") else [])]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConvertError(f"{manifest}: cannot tell which files it lists ({type(e).__name__}: {e}); move the old "
                           "dataset away by hand") from None
    for f in files:
        parts = PurePosixPath(f).parts if isinstance(f, str) else ("..",)
        if not parts or parts[0] in ("/", "..", *OURS) or ".." in parts:
            raise ConvertError(f"{manifest}: lists {f!r}, outside the dataset's own files; not deleting anything")
    return files
