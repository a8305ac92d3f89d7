"""A full disk, for real: a tmpfs of a few MiB (mounted as root; the tests that need it skip where mounting is not
allowed), filled up to a given free space, and a child process under a file-size limit (``RLIMIT_FSIZE``, with
SIGXFSZ ignored so that write() fails with EFBIG, as under ``ulimit -f``; the variant that runs everywhere). A
read-only directory, for real: a read-only bind mount (root, which CI runs as, ignores permission bits)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import repo_first, scaled

TMPFS_BYTES = 2 << 20


@contextlib.contextmanager
def tmpfs(where: Path, size: int = TMPFS_BYTES) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``where`` (made), unmounted after; skip the test if it cannot be."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True, timeout=scaled(30))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the RLIMIT_FSIZE tests cover the writers")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=scaled(30), check=False)


@contextlib.contextmanager
def read_only(source: Path, where: Path) -> Iterator[Path]:
    """``source`` seen read-only at ``where`` (made): a bind mount remounted ``ro``, unmounted after; skip the test
    if it cannot be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(source), str(where)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({r.stderr.strip()})")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True, text=True,
                           timeout=30)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({r.stderr.strip()})")
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)


def fill(root: Path, leave: int) -> None:
    """Write a ballast file into ``root``'s filesystem until ``leave`` bytes (or less) are free."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    with open(root / "ballast", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))
    st = os.statvfs(root)
    assert st.f_bavail * st.f_frsize <= leave + st.f_frsize


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def run_limited(code: str, args: list[object], fsize: int, timeout: float = 240,
                now: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` with every file it writes limited to ``fsize`` bytes (EFBIG past it): from the
    start, or (``now=False``) from where ``code`` calls ``limit()``."""
    prelude = ("import resource, signal, sys\n"
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a killed process\n"
               f"def limit(): resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n"
               + ("limit()\n" if now else ""))
    return subprocess.run([sys.executable, "-c", prelude + code, *map(str, args)], capture_output=True, text=True,
                          timeout=scaled(timeout), env=repo_first(dict(os.environ)), start_new_session=True)


SHARDIFY = "from lifeseq_shards.cli import main\nsys.argv[0] = 'shardify'\nmain()\n"  # run_limited's code for the CLI


def error_lines(text: str) -> list[str]:
    """The CLI's one-line errors in its output."""
    return [line for line in text.splitlines() if line.startswith("error:")]
