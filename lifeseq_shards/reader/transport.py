"""How batches cross from DataLoader workers to the training process: the workers' shared-memory rings (both sides:
:class:`RingWriter` in each worker, :class:`RingReader` in the main process, the only code that touches their control
words), the forkserver context they start from (with wide result pipes), and the watch that ends a worker with its
owner.

:class:`WorkerLink` is the one value the loader hands the dataset (``ShardedDataset.attach``) before its workers
start: how many batches go in a message, the rings, and the process the workers exit with.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import multiprocessing.context
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .mainguard import main_imports

PRELOAD = ("torch", "webdataset", "lifeseq_shards.reader")  # what the workers' forkserver imports for any script
PIPE_BYTES = 1 << 20  # the workers' result pipe; Linux's default /proc/sys/fs/pipe-max-size


@dataclass(frozen=True)
class WorkerLink:
    """What a loader tells its dataset's workers: ``batches_per_message`` batches per item they send (a list of
    them when > 1); the shared-memory ``rings`` (one row per worker) and their control words ``ring_ctl`` ([0] the
    loader's current iteration, [1 + k] how far the main process has copied out of worker k's ring), None when
    batches go through the pipes; and ``owner``, the process reading the batches, which the workers die with."""

    batches_per_message: int = 1
    rings: torch.Tensor | None = None
    ring_ctl: torch.Tensor | None = None
    owner: int = 0


@dataclass(frozen=True)
class RingEntry:
    """Where a packed batch waits in a worker's ring: bytes [offset, offset + nbytes) of row ``worker``; ``end`` is
    the writer's position after it (what the main process releases once it has copied the batch)."""

    worker: int
    offset: int
    nbytes: int
    end: int


class RingReader:
    """The main process's side of the workers' rings (made afresh for workers about to start): it owns the control
    words. :meth:`take` copies a batch out of its worker's ring and releases those bytes to the writer
    (``ctl[1 + worker]``, see :class:`RingWriter`); :meth:`begin` and :meth:`end` bracket one iteration of the
    loader (``ctl[0]``), so that the passes of older iterations stop waiting for room."""

    def __init__(self, num_workers: int, ring_bytes: int) -> None:
        self.rings = torch.zeros((num_workers, ring_bytes), dtype=torch.uint8).share_memory_()
        self.ctl = torch.zeros(1 + num_workers, dtype=torch.int64).share_memory_()
        self._data, self._words = self.rings.numpy(), self.ctl.numpy()

    def begin(self) -> int:
        """A new iteration, before the DataLoader restarts the workers' passes; returns its number for :meth:`end`."""
        iteration = int(self._words[0]) + 1
        self._words[0] = iteration
        return iteration

    def end(self, iteration: int) -> None:
        """``iteration`` is exhausted or abandoned: its workers stop waiting for room (unless a newer one took over)."""
        if int(self._words[0]) == iteration:
            self._words[0] = iteration + 1

    def take(self, entry: RingEntry, pin_memory: bool) -> torch.Tensor:
        """The batch's bytes in a tensor of their own (pinned when ``pin_memory``); its ring space is then the
        writer's again. The main process takes each worker's batches in the order they were written."""
        out = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        # numpy's copy: torch's would split a large copy over intra-op threads that compete with the workers
        out.numpy()[:] = self._data[entry.worker, entry.offset : entry.offset + entry.nbytes]
        self._words[1 + entry.worker] = entry.end
        return out


class RingWriter:
    """A worker's side of its shared-memory ring: packed batches are written one after another (a batch never wraps:
    it starts again at offset 0), at absolute positions that only grow. The main process copies each worker's
    batches out in the order they were written (the in-order DataLoader returns them so) and stores the position
    after the last one in ``ctl[1 + worker]``; the writer waits while a batch would overwrite bytes not copied yet.
    A message is written only when it is complete and about to be sent, so the writer only ever waits for
    batches already on their way to the main process.

    That holds within one iteration of the loader. When the main process stops copying (a new iterator drains the
    old one's batches unread, or the iteration was abandoned), it moves ``ctl[0]`` on, and a pass of an older
    iteration no longer waits: whatever it still writes is never read. A pass starts after every batch of the
    passes before it was written, so the bytes it must keep are only its own."""

    def __init__(self, rings: torch.Tensor, ctl: torch.Tensor, worker: int) -> None:
        self.ring = rings[worker].numpy()
        self.ctl = ctl.numpy()
        self.worker = worker
        self.capacity = len(self.ring)
        # positions go on from what the main process last released (rings outlive a worker that restarts)
        self.head = self.base = int(self.ctl[1 + worker])
        self.iteration = -1
        self.parent = os.getppid()

    def new_pass(self) -> None:
        self.base, self.iteration = self.head, int(self.ctl[0])

    def _must_wait(self, end: int) -> bool:
        copied = max(int(self.ctl[1 + self.worker]), self.base)
        return end - copied > self.capacity and int(self.ctl[0]) == self.iteration

    def fits(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` goes in (a batch moved to the ring start wastes at most its own size)."""
        return 2 * nbytes <= self.capacity

    def put(self, buf: np.ndarray) -> RingEntry:
        """Copy ``buf`` into the ring, waiting for room."""
        n = buf.nbytes
        pos = self.head
        if pos % self.capacity + n > self.capacity:  # not enough room before the end: start at offset 0
            pos += self.capacity - pos % self.capacity
        while self._must_wait(pos + n):
            if os.getppid() != self.parent:  # the training process is gone: nobody will copy these out
                raise RuntimeError("the process reading this worker's batches exited")
            time.sleep(0.0002)
        offset = pos % self.capacity
        self.ring[offset : offset + n] = buf.view(np.uint8)
        self.head = pos + n
        return RingEntry(self.worker, offset, n, self.head)


_watched: int | None = None  # the process this worker process exits with (one watching thread per process)


def exit_with(owner: int) -> None:
    """End this DataLoader worker as soon as ``owner`` (the process reading its batches) ends, however it ends.

    torch's workers only check that their parent lives; a forkserver worker's parent is the forkserver, which in
    turn waits for its clients, the workers among them. After a SIGKILL of the training process (an out-of-memory
    kill) both would live on with its stdout and stderr: ``python train.py | tee log`` would never end, and the
    resource tracker, which removes the queues' semaphores from /dev/shm, would wait for them too."""
    global _watched
    if _watched == owner or not hasattr(os, "pidfd_open"):  # pidfds: Linux 5.3+; elsewhere torch's check only
        return
    _watched = owner
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except OSError:  # a kernel before 5.3, or a sandbox without pidfds: torch's check only
        return
    threading.Thread(target=_exit_when_readable, args=(fd,), name="lifeseq-exit-with-owner", daemon=True).start()


def _exit_when_readable(fd: int) -> None:
    select.select([fd], [], [])  # a pidfd turns readable when its process ends
    os._exit(1)


class _WorkerContext(multiprocessing.context.ForkServerContext):
    """Workers start from a clean forkserver process, not forked from a training process whose thread pools, gloo
    threads or pin-memory thread may hold a lock at the moment of the fork (a rare, random deadlock of the new
    worker: pytorch/pytorch#130610). The server imports torch, the reader and what the main script imports
    (:func:`~.mainguard.main_imports`) once, so a worker starts in a fraction of a second. Like spawn, it needs
    the training script's ``if __name__ == "__main__":`` guard; pass ``multiprocessing_context="fork"`` to
    ShardedLoader to choose otherwise.

    Its queues' pipes hold ``PIPE_BYTES`` instead of 64 KiB, so a packed batch crosses from a worker in one write
    and one read, not in several handovers that hold the queue's lock against the other workers."""

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802 (multiprocessing's name)
        queue = super().Queue(maxsize)
        with contextlib.suppress(OSError, AttributeError):  # not Linux, or a lower pipe-max-size: keep 64 KiB
            fcntl.fcntl(queue._reader.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return queue


def worker_context() -> multiprocessing.context.BaseContext:
    ctx = _WorkerContext()
    ctx.set_forkserver_preload([*PRELOAD, *main_imports()])
    return ctx
