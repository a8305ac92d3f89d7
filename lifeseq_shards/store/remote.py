"""Where a dataset's files are read from, at the I/O edge: a dataset root or a shard's URL (a plain path on a local
or shared filesystem, an http(s) URL, or a ``pipe:`` command) turned into its bytes or a stream, and the one read of
a dataset's manifest (:func:`read_manifest`; :mod:`.manifest` parses it, and reads nothing).

Every remote read runs a command (curl for http(s), the user's command under ``sh`` for ``pipe:``) that reads
with a stall limit, ``LIFESEQ_HTTP_STALL_S`` seconds without a byte (default 60): curl gives up on a stalled body
itself and retries for at most 5x that; a ``pipe:`` command that sends nothing for that long is killed and the
read fails. The command runs in a process group of its own, which is killed when its stream is closed before the
end and when the process reading it dies, however it dies (the kernel's parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from .manifest import MANIFEST, Manifest, ManifestError, parse_manifest
from .shardfile import ShardFile

STALL_ENV = "LIFESEQ_HTTP_STALL_S"
DEFAULT_STALL_S = 60
CHUNK = 1 << 20  # bytes asked of the command per read, and the pipe's size where Linux allows it
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# `sh -c` runs the user's command in the background and waits: the parent-death signal (TERM) then reaches a shell
# whose trap kills the whole group, the command's own children included; the newlines end a `#` comment in it
SHELL = "trap 'kill -KILL 0' TERM\n(\n{}\n) &\nwait $!"
CURL_STATUS = {6: "host not found", 7: "cannot connect", 22: "an HTTP error status", 28: "no byte for {} s, retried "
               "until {} s had passed ({})"}


class RemoteSettingError(ValueError):
    """A setting of remote reads that cannot work; the message is one line naming the variable."""


def stall_seconds() -> int:
    """``LIFESEQ_HTTP_STALL_S``, refused in one line unless a whole number of seconds >= 1 (0 would turn the
    limit off and let a stalled read hang the job forever)."""
    text = os.environ.get(STALL_ENV)
    if text is None:
        return DEFAULT_STALL_S
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise RemoteSettingError(f"{STALL_ENV}={text!r}: the seconds a remote read may go without a byte before it "
                                 f"fails must be a whole number >= 1 (default {DEFAULT_STALL_S}); there is no 'off'")
    return value


def is_local(url: str) -> bool:
    """A plain path (local or shared filesystem), not an http(s) URL or a ``pipe:`` command."""
    return "://" not in url and not url.startswith("pipe:")


def dataset_url(root: str, relative: str) -> str:
    """Where a dataset file lives: ``root/relative`` for a directory or http(s) base, or, for a ``pipe:`` root, the
    command with ``{}`` replaced (``pipe:aws s3 cp s3://bucket/ds/{} -`` streams any file of the dataset)."""
    if root.startswith("pipe:"):
        if "{}" not in root:
            raise ManifestError(f"{root}: a pipe: dataset root needs a {{}} where the file name goes")
        return root.replace("{}", relative)
    return f"{root.rstrip('/')}/{relative}"


def read_manifest(root: str | os.PathLike[str]) -> Manifest:
    """The manifest of a dataset root: a local directory, an http(s) base URL or a ``pipe:`` command."""
    where = dataset_url(str(root), MANIFEST)
    return parse_manifest(fetch_manifest(where), where)


def fetch_manifest(url: str) -> bytes:
    """The bytes of the manifest at ``url`` (a path, an http(s) URL or a ``pipe:`` command); ManifestError, one
    line, when it cannot be read."""
    if is_local(url):
        path = Path(url)
        if not path.exists():
            raise ManifestError(f"{path}: no manifest (not a converted dataset, or its conversion did not finish)")
        return path.read_bytes()
    stall = stall_seconds()  # a setting that cannot work is its own error, not the manifest's
    try:
        with open_remote(url, stall) as stream:
            data = stream.read()
    except OSError as e:
        raise ManifestError(f"{url}: cannot read the manifest ({e})") from None
    if stream.failure():
        raise ManifestError(f"{url}: cannot read the manifest{stream.failure()}")
    return data


def open_file(url: str) -> IO[bytes] | CommandStream:
    """A dataset file as a stream to read sequentially: a plain path opened directly (webdataset's gopen would parse
    the URL and read its environment on every call), anything else through :func:`open_remote`. Close it with
    :func:`close_file`."""
    return open(url, "rb") if is_local(url) else open_remote(url)


def close_file(stream: IO[bytes] | CommandStream) -> str:
    """Close a stream of :func:`open_file`; for a command read to its end, say how it failed ("" when it did not, or
    for a plain file). A command closed before its end was stopped by its reader, which had what it needed."""
    stream.close()
    return stream.failure() if isinstance(stream, CommandStream) else ""


def open_remote(url: str, stall: int | None = None) -> CommandStream:
    """A remote dataset file (http(s) or ``pipe:``) as a stream; ``stall`` defaults to :func:`stall_seconds`."""
    stall = stall_seconds() if stall is None else stall
    if url.startswith(("http://", "https://")):
        args = ["curl", "--connect-timeout", "30", "--retry", "30", "--retry-delay", "2", "--retry-max-time",
                str(5 * stall), "--speed-limit", "1", "--speed-time", str(stall), "-f", "-s", "-L", url]
        return CommandStream(args, stall, None, "curl")
    if not url.startswith("pipe:"):
        raise ValueError(f"{url}: not an http(s) URL or a pipe: command")
    return CommandStream(["sh", "-c", SHELL.format(url[len("pipe:"):])], stall, stall, "the command")


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _dies_with(reader: int) -> Callable[[], None]:
    """What the command's process runs before it execs: TERM when ``reader`` dies (or already has). Only the
    pre-resolved libc call and getppid run between fork and exec: no import, no allocation that a lock held by
    another thread at the fork could block."""
    def set_signal() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != reader:
            os._exit(1)
    return set_signal


class CommandStream:
    """A command's stdout read in chunks: ``read`` fails after ``guard`` seconds without a byte (None: the command
    has its own limit), killing the command. ``close`` kills a command whose output was not read to the end (it is
    ours to stop); ``failure()`` says how a command that was read to the end failed ("" when it did not)."""

    def __init__(self, args: list[str], stall: int, guard: int | None, name: str) -> None:
        self.stall, self.guard, self.name = stall, guard, name
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, bufsize=0,
                                     start_new_session=True, preexec_fn=_dies_with(os.getpid()))
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        with contextlib.suppress(OSError):  # a lower pipe-max-size: the default 64 KiB
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, CHUNK)
        self._buf, self._pos = b"", 0
        self.eof = False
        self.status: int | None = None

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left when negative); fewer only at the end of the output."""
        if size < 0:
            parts = [self._take(len(self._buf))]
            while not self.eof:
                parts.append(self._chunk())
            return b"".join(parts)
        if self._pos == len(self._buf) and not self.eof and size:  # a tar's empty padding asks for 0 bytes
            self._buf, self._pos = self._chunk(), 0
        return self._take(size)

    def _take(self, size: int) -> bytes:
        out = self._buf[self._pos : self._pos + size]
        self._pos += len(out)
        return out

    def _chunk(self) -> bytes:
        if self.guard is not None:
            ready, _, _ = select.select([self._fd], [], [], self.guard)
            if not ready:
                self._kill()
                raise OSError(f"{self.name} sent no byte for {self.guard} s ({STALL_ENV}); killed it")
        data = os.read(self._fd, CHUNK)
        self.eof = not data
        return data

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.proc.stdout is None or self.proc.stdout.closed:
            return
        self.proc.stdout.close()
        if not self.eof:  # stopped where its reader had what it needed: ours to stop
            self._kill()
        elif not self._exits_within(self.stall):  # closed its output but runs on
            self._kill()
        self._kill()  # what it left running in its group, while the unreaped leader keeps the group's id
        self.status = self.proc.wait()

    def _exits_within(self, seconds: float) -> bool:
        """Whether the command ends within ``seconds``, without reaping it."""
        deadline = time.monotonic() + seconds
        while os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def failure(self) -> str:
        """How a command read to its end failed, as `` (... exited with status N[: meaning])``; "" otherwise."""
        if not self.eof or self.status in (0, None):
            return ""
        meaning = CURL_STATUS.get(self.status, "") if self.name == "curl" else ""
        meaning = meaning.format(self.stall, 5 * self.stall, STALL_ENV)
        return f" ({self.name} exited with status {self.status}{': ' + meaning if meaning else ''})"

    def __enter__(self) -> CommandStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def require_block_checks(manifest: Manifest, shards: Sequence[ShardFile], root: str) -> None:
    """ManifestError (one line, with the command that fixes it) unless the reader can check every block of
    ``shards`` against the manifest: without the blocks' checksums, a block swapped inside a shard is read without a
    word (its persons twice, the block's own never)."""
    if all(s.block_checksums is not None for s in shards):
        return
    run = f"`shardify upgrade {root}`" if is_local(root) else "`shardify upgrade DIR` where its files are"
    raise ManifestError(f"{root}: a format-{manifest.format_version} dataset without per-block checksums (a block "
                        f"swapped inside a shard would be read without a word): run {run} to verify it and add them")
