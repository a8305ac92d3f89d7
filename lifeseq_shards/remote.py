"""Dataset files behind http(s) or a ``pipe:`` command, as streams that cannot hang a job or outlive it.

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
from collections.abc import Callable
from typing import Any

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
