"""The DDP reader: a webdataset pipeline whose node/worker split comes from the pure plan, not from the environment.

Stages (each a small generator, composed in a ``webdataset.DataPipeline``):
``slot_windows`` (which persons this rank+worker reads this epoch, in which order, cut into windows)
-> ``load_windows`` (stream the needed tar members over webdataset's gopen: a local or shared filesystem, http(s),
or a ``pipe:`` command; decode only the blocks needed)
-> ``batches`` (gather each batch's persons in narrow dtypes: padded to a multiple of 8, or packed into one buffer
of real tokens that the device pads)
-> ``messages`` (in DataLoader workers: a few batches per item, so the main process pays its per-item cost once for
them; packed batches' bytes go into the worker's shared-memory ring and only their places cross the pipe;
:class:`ShardedLoader` copies them out and hands them out one by one).

Rank and world size are captured at construction in the launching process, so spawned DataLoader workers (where
``torch.distributed`` is not initialised and RANK is unset) cannot lose them. The epoch and the resume point reach
workers through a small shared-memory tensor, so persistent workers see them too.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import multiprocessing.context
import os
import select
import shutil
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import webdataset as wds
import zstandard
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import plan
from .format import (
    COUNT_OF,
    RAGGED,
    SCALAR,
    Block,
    concat_blocks,
    decode_member,
    expand_runs,
    ragged_counts,
    token_schema,
)
from .manifest import MANIFEST, ManifestError, Split, dataset_url, is_local, read_manifest
from .shardfile import ShardFile, iter_tar_members

TRAIN, INFERENCE = plan.TRAIN, plan.INFERENCE
MAX_WORKERS = 256
MAX_PREFETCH = 64  # messages in flight per worker, at most
PIPE_BYTES = 1 << 20  # the workers' result pipe; Linux's default /proc/sys/fs/pipe-max-size
# Persons per worker message; the main process pays the DataLoader's per-item costs once per message. Through the
# rings only slots cross the pipe: 16 batches of 256 (docs/performance.md, change 17). Through the pipe a message
# crosses in one write only if the pipe holds it: ~800 KB packed, 4 batches of 256 (change 15).
RING_MESSAGE_PERSONS = 4096
PIPE_MESSAGE_PERSONS = 1024
RING_PERSON_BYTES = 1024  # ring bytes per person in flight (a packed person is ~770 B in the bench, more with MLM)
SHM_DIR = "/dev/shm"


# (rank, world size) variables of the launchers, in the order they are asked: torchrun's, then Slurm's (srun sets
# them for every task; a script run by srun without torchrun has only these)
LAUNCHER_VARS = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))


def default_rank_world() -> tuple[int, int]:
    """torch.distributed when initialised, else torchrun's RANK / WORLD_SIZE, else srun's SLURM_PROCID /
    SLURM_NTASKS, else a single process. Refuses an environment that announces several processes without saying
    which one this is: every process would read everything."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    for rank_var, world_var in LAUNCHER_VARS:
        rank, world = os.environ.get(rank_var), os.environ.get(world_var)
        if rank is not None:
            return int(rank), int(world if world is not None else 1)
        if world is not None and int(world) > 1:
            raise RuntimeError(f"{world_var}={world} says there are {world} processes but {rank_var} is not set: "
                               "this process cannot tell which part of the data is its own. Launch with torchrun or "
                               "srun, or pass rank= and world_size= to ShardedDataset")
    return 0, 1


class DatasetChanged(RuntimeError):
    """A resume state was saved for another dataset (its fingerprint differs)."""


@dataclass(frozen=True)
class Piece:
    """Persons [start, stop) of one shard file."""

    shard: ShardFile
    start: int
    stop: int


@dataclass(frozen=True)
class Window:
    """A run of a slot's stream loaded at once; ``order`` permutes its persons."""

    pieces: tuple[Piece, ...]
    order: np.ndarray
    offset: int  # stream position of the window's first person


class ShardedDataset(IterableDataset):
    """Collated batches of one split, each person exactly once per epoch across all ranks and workers.

    ``split`` may name several splits in ``mode="inference"`` (e.g. ``("train", "val")`` to embed everyone).

    Use with :class:`ShardedLoader` (or ``DataLoader(ds, batch_size=None, num_workers=ds.num_workers)``).
    ``len()`` is the exact number of batches this rank yields per epoch.
    """

    def __init__(self, path: str | os.PathLike[str], split: str | Sequence[str] = "train", batch_size: int = 256, *,
                 rank: int | None = None, world_size: int | None = None, num_workers: int = 0,
                 mode: str = TRAIN, shuffle: bool | None = None, seed: int = 0, drop_last: bool = False,
                 pad_multiple: int = 8, pad_to: int | None = None, window_shards: int = 2,
                 window_persons: int = 4096,
                 packed: bool = False) -> None:
        super().__init__()
        if mode not in (TRAIN, INFERENCE):
            raise ValueError(f"mode must be {TRAIN!r} or {INFERENCE!r}, not {mode!r}")
        self.root = str(path) if str(path).startswith("pipe:") else str(path).rstrip("/")
        self.manifest = read_manifest(self.root)
        splits = [split] if isinstance(split, str) else list(split)
        missing = [s for s in splits if s not in self.manifest.splits]
        if missing or not splits:
            raise ValueError(f"{self.root}: no split {missing or splits!r} (has {', '.join(self.manifest.splits)})")
        if len(splits) > 1 and mode != INFERENCE:
            raise ValueError("several splits are read together only in mode='inference' (training shards of "
                             "different splits differ in size)")
        if rank is None or world_size is None:
            d_rank, d_world = default_rank_world()
            rank, world_size = d_rank if rank is None else rank, d_world if world_size is None else world_size
        self.rank, self.world_size = rank, world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if not 0 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers {num_workers} outside 0..{MAX_WORKERS}")
        self.split, self.batch_size, self.mode, self.seed = split, batch_size, mode, seed
        self.shuffle = (mode == TRAIN) if shuffle is None else (shuffle and mode == TRAIN)
        self.num_workers, self.drop_last = num_workers, drop_last
        self.pad_multiple, self.pad_to, self.packed = pad_multiple, pad_to, packed
        if packed and pad_to is not None:
            raise ValueError("packed batches are padded on the device (lifeseq_shards.device.unpack): no pad_to")
        self.schema = self.manifest.schema
        # offline MLM targets point into the whole sequence: such a dataset is padded to pad_to, never cropped
        self.offline_mlm = self.manifest.offline_mlm
        if not self.manifest.fingerprint_matches:
            raise ManifestError(f"{dataset_url(self.root, MANIFEST)}: fingerprint does not match its schema and shard "
                                "checksums (edited by hand?); `shardify verify` checks the rest")
        entries = [e for name in splits for e in self.manifest.splits[name].entries(remainder=mode == INFERENCE)]
        self.shards = [self.manifest.shard_file(e, dataset_url(self.root, e.file)) for e in entries]
        self.sizes = [e.samples for e in entries]
        # the shuffle window: a few shards, and never so few persons that the shuffle stays local
        self.window = max(window_persons, window_shards * max(self.sizes, default=1))
        self.fingerprint = self.manifest.fingerprint
        # [0] epoch of the next pass, [1] batches of it to skip (resume), [2+k] passes started by worker k since then
        self._ctl = torch.zeros(2 + max(1, num_workers), dtype=torch.int64).share_memory_()
        # batches per item a DataLoader worker sends (a list of them when > 1); ShardedLoader sets it and unpacks
        self.batches_per_message = 1
        # the workers' shared-memory rings (one row per worker) and their control words: [0] the loader's current
        # iteration, [1 + k] how far the main process has copied out of worker k's ring; ShardedLoader sets them
        # before its workers start
        self.rings: torch.Tensor | None = None
        self.ring_ctl: torch.Tensor | None = None
        self._ring_writer: RingWriter | None = None  # this worker's, kept across its passes
        self._owner = os.getpid()  # the process that reads the batches: workers die with it (ShardedLoader resets it)
        self._warn_static_balance(self.manifest.splits[splits[0]])

    # -- the plan ---------------------------------------------------------------------------------------------
    def _warn_static_balance(self, info: Split) -> None:
        if self.mode != TRAIN or not self.sizes:
            return
        slots = plan.num_slots(self.world_size, self.num_workers)
        lost = plan.left_out(self.sizes, self.world_size, self.num_workers, self.mode)
        rem = info.remainder_persons
        if len(self.sizes) % slots:
            lost_text = (f"{lost} persons are left out this epoch (a different {lost} each epoch)" if lost
                         else "no person is left out, but some shards are split between readers")
            warnings.warn(
                f"{self.split}: {len(self.sizes)} shards do not divide {slots} readers ({self.world_size} ranks x "
                f"{max(1, self.num_workers)} workers); balancing statically from the manifest: {lost_text}; "
                f"training also skips the {rem}-person remainder shard. "
                f"`shardify plan` lists worker counts that divide exactly.",
                stacklevel=3,
            )

    def per_worker_batches(self) -> list[int]:
        """Batches each worker of this rank yields per epoch (the same every epoch)."""
        k = max(1, self.num_workers)
        segs = plan.assign(self.sizes, self.world_size, self.num_workers, mode=self.mode, shuffle=False)
        slots = [plan.slot_index(self.rank, w, self.num_workers) for w in range(k)]
        return [plan.num_batches(plan.slot_persons(segs[s]), self.batch_size, self.drop_last) for s in slots]

    def __len__(self) -> int:
        return sum(self.per_worker_batches())

    # -- epochs and resume ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` (the one after it ``epoch + 1``, ...); reaches persistent workers."""
        self._ctl.zero_()
        self._ctl[0] = epoch

    def next_epoch(self) -> int:
        """Epoch number of the next pass, as the workers will compute it."""
        return int(self._ctl[0] + self._ctl[2])

    def resume_at(self, epoch: int, batches: int) -> None:
        """The next pass is ``epoch``, skipping the first ``batches`` batches the loader had returned."""
        self.set_epoch(epoch)
        self._ctl[1] = batches

    def _claim_pass(self, worker: int) -> tuple[int, int]:
        passes = int(self._ctl[2 + worker])
        self._ctl[2 + worker] = passes + 1
        skip_total = int(self._ctl[1]) if passes == 0 else 0
        return int(self._ctl[0]) + passes, skip_total

    # -- iteration --------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, k = (0, 0) if info is None else (info.id, info.num_workers)
        if info is not None:
            _exit_with(self._owner)
        if k != self.num_workers:
            raise RuntimeError(
                f"ShardedDataset was built for num_workers={self.num_workers} but runs in a DataLoader with "
                f"num_workers={k}: the plan would overlap or miss persons. Pass the same num_workers to both "
                "(ShardedLoader does it for you)."
            )
        epoch, skip_total = self._claim_pass(worker)
        per_worker = self.per_worker_batches()
        per_message = self.batches_per_message if k else 1
        consumed = plan.worker_batches_consumed(skip_total, self.num_workers, per_worker, per_message)
        # A fresh DataLoader asks worker 0 first, but the batch due next may be another worker's: resume rotates the
        # workers' roles so that the worker asked first plays the one whose batch is due (this pass only).
        role = (worker + _first_due(consumed, per_worker, per_message)) % len(per_worker)
        skip = consumed[role]
        slot = plan.slot_index(self.rank, role, self.num_workers)
        stages = [
            lambda: slot_windows(self, slot, epoch, skip),
            lambda src: load_windows(src, self.schema),
            lambda src: batches(src, self, skip),
        ]
        writer = None
        if self.rings is not None:  # ShardedLoader made rings: workers and packed batches
            if self._ring_writer is None:
                assert self.ring_ctl is not None
                self._ring_writer = RingWriter(self.rings, self.ring_ctl, worker)
            writer = self._ring_writer
            writer.new_pass()
        if per_message > 1 or writer is not None:
            stages.append(lambda src: messages(src, per_message, skip, writer))
        return iter(wds.DataPipeline(*stages))


_watched: int | None = None  # the process this worker process exits with (one watching thread per process)


def _exit_with(owner: int) -> None:
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


def _first_due(consumed: list[int], per_worker: list[int], per_message: int) -> int:
    """The worker whose message an in-order DataLoader returns after ``consumed`` batches: the unfinished one with
    the fewest whole messages returned, the lowest id among equals (round-robin that skips exhausted workers)."""
    due = [(c // per_message, k) for k, (c, total) in enumerate(zip(consumed, per_worker, strict=True)) if c < total]
    return min(due)[1] if due else 0


def slot_windows(ds: ShardedDataset, slot: int, epoch: int, skip: int) -> Iterator[Window]:
    """Stage 1: the windows of this slot's stream that hold its batches from ``skip`` on (no I/O)."""
    segs = plan.assign(ds.sizes, ds.world_size, ds.num_workers, mode=ds.mode, seed=ds.seed, epoch=epoch,
                       shuffle=ds.shuffle)[slot]
    total = plan.slot_persons(segs)
    n = plan.num_batches(total, ds.batch_size, ds.drop_last)
    first = min(skip * ds.batch_size, total)
    last = min(n * ds.batch_size, total)
    starts = np.cumsum([0] + [s.size for s in segs])
    for w in range(first // ds.window, -(-last // ds.window)):
        lo, hi = w * ds.window, min((w + 1) * ds.window, total)
        pieces = []
        s = int(np.searchsorted(starts, lo, side="right")) - 1  # the segment holding position lo
        while s < len(segs) and starts[s] < hi:
            a, b = max(lo, int(starts[s])), min(hi, int(starts[s + 1]))
            if a < b:
                seg = segs[s]
                pieces.append(Piece(ds.shards[seg.shard], seg.start + a - int(starts[s]),
                                    seg.start + b - int(starts[s])))
            s += 1
        order = (plan.window_order(total, ds.window, ds.seed, epoch, slot, w) - lo if ds.shuffle
                 else np.arange(hi - lo))
        yield Window(tuple(pieces), order, lo)


def load_windows(src: Iterator[Window], schema: list) -> Iterator[tuple[Window, Block]]:
    """Stage 2: read each window's persons (only the blocks it needs are decompressed), joined in one copy."""
    for win in src:
        parts = [b for p in win.pieces for b in read_piece(p, schema)]
        yield win, concat_blocks(parts, schema) if len(parts) != 1 else parts[0]


def read_piece(piece: Piece, schema: list) -> list[Block]:
    """The blocks holding persons [start, stop) of one shard, each cut to that range (views, no copy). Every member
    met is checked against the manifest (:class:`ShardFile`), and a read of the shard's last block makes sure that
    none follows it: a shard that is not the manifest's, or holds other counts, fails here, naming it."""
    shard, bp = piece.shard, piece.shard.block_persons
    first, last = piece.start // bp, (piece.stop - 1) // bp
    blocks = []
    i = 0  # the member being read
    # a plain path opens directly: webdataset's gopen parses the URL and reads its environment on every call
    stream = open(shard.url, "rb") if is_local(shard.url) else wds.gopen(shard.url, "rb")
    try:
        for name, data in iter_tar_members(stream):
            shard.check_member(i, name, data)
            if i >= first:
                block = decode_member(data, schema, shard.tag)
                shard.check_block(i, block)
                blocks.append(block.slice(max(piece.start - i * bp, 0), min(piece.stop - i * bp, block.n), schema))
                if i == last < shard.blocks - 1:
                    break
            i += 1
    except (OSError, ValueError, zstandard.ZstdError) as e:  # a damaged shard: say which one, in one line
        raise OSError(f"{shard.url}: block {i}: {e}") from None
    finally:
        stream.close()
    if len(blocks) != last - first + 1:
        raise OSError(f"{shard.url}: ended after {first + len(blocks)} blocks, needed {last + 1}")
    return blocks


def batches(src: Iterator[tuple[Window, Block]], ds: ShardedDataset, skip: int) -> Iterator[dict[str, Any]]:
    """Stage 3: cut the permuted stream into batches and collate them: one gather per batch from its window (a
    batch that spans two windows joins its two parts), so the cost is linear in the persons read."""
    carry: Block | None = None
    b = skip
    for win, block in src:
        order = win.order[max(b * ds.batch_size - win.offset, 0):]  # resume may start inside the first window
        i = 0
        if carry is not None:
            i = min(ds.batch_size - carry.n, len(order))
            carry = concat_blocks([carry, block.take(order[:i], ds.schema)], ds.schema)
            if carry.n < ds.batch_size:
                continue
            yield collate(carry, ds)
            b, carry = b + 1, None
        while i + ds.batch_size <= len(order):
            yield collate(block, ds, order[i : i + ds.batch_size])
            b, i = b + 1, i + ds.batch_size
        if i < len(order):
            carry = block.take(order[i:], ds.schema)
    if carry is not None and not ds.drop_last:
        yield collate(carry, ds)


class RingViews(NamedTuple):
    """The main process's numpy views of the workers' rings (one row each) and of their control words."""

    data: np.ndarray
    ctl: np.ndarray


@dataclass(frozen=True)
class RingSlot:
    """Where a packed batch waits in a worker's ring: bytes [offset, offset + nbytes) of row ``worker``; ``end`` is
    the writer's position after it (what the main process releases once it has copied the batch)."""

    worker: int
    offset: int
    nbytes: int
    end: int


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

    def put(self, buf: np.ndarray) -> RingSlot:
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
        return RingSlot(self.worker, offset, n, self.head)


def messages(src: Iterator[dict[str, Any]], per_message: int, first: int,
             writer: RingWriter | None = None) -> Iterator[list[dict[str, Any]]]:
    """Stage 4 (DataLoader workers): lists of ``per_message`` batches, cut at multiples of it in the worker's own
    batch numbering (batch ``first`` is the first one read), so that a resumed pass sends the same messages as an
    uninterrupted one from its first whole message on. With a ``writer``, a complete message's packed buffers go
    into the worker's ring and RingSlots take their place: the pipe then carries a few hundred bytes per batch.
    A message too large for the ring keeps its buffers and travels through the pipe."""
    def send(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if writer is not None and writer.fits(sum(b["packed"].nbytes for b in group)):
            for batch in group:
                batch["packed"] = writer.put(batch["packed"])
        return group

    group: list[dict[str, Any]] = []
    for b, batch in enumerate(src, start=first):
        group.append(batch)
        if (b + 1) % per_message == 0:
            yield send(group)
            group = []
    if group:
        yield send(group)


def collate(block: Block, ds: ShardedDataset, index: np.ndarray | None = None) -> dict[str, Any]:
    """Persons ``index`` of ``block`` (all of it when None) as a batch: packed when ``ds.packed``, else padded."""
    if ds.packed:
        return collate_packed(block, ds, np.arange(block.n) if index is None else index)
    return collate_padded(block if index is None else block.take(index, ds.schema), ds)


def collate_packed(block: Block, ds: ShardedDataset, index: np.ndarray) -> dict[str, Any]:
    """The whole batch in ONE uint8 array: each field's values (ragged ones concatenated: only real tokens cross
    the bus) 8-byte aligned, described by ``fields`` = ((name, dtype, offset, count), ...), plus the padded widths
    as ints. Values are gathered straight from the window's block into the buffer (one copy). A numpy array, not a
    tensor, on purpose: in a DataLoader worker it is copied into the worker's ring (or pickled through its pipe)
    where a tensor would go through a fresh shared-memory segment (about 4 ms for 400 KB here, more than the whole
    batch costs to make). :class:`ShardedLoader` turns it into a (pinned) tensor; ``lifeseq_shards.device.unpack``
    into named, padded tensors on the device."""
    c = block.columns
    flat = {k: block.gather_index(index, k) for k in ragged_counts(ds.schema)}
    sources = [(f, index if f.kind == SCALAR else flat[COUNT_OF[f.kind]]) for f in ds.schema]
    fields, offset = [], 0
    for f, idx in sources:
        dtype = c[f.name].dtype
        fields.append((f.name if f.name != "length" else "lengths", dtype.str, offset, len(idx)))
        offset += -(-len(idx) * dtype.itemsize // 8) * 8
    buf = np.empty(offset, dtype=np.uint8)
    columns = {}
    for (name, dtype, off, count), (f, idx) in zip(fields, sources, strict=True):
        end = off + count * np.dtype(dtype).itemsize
        buf[end : end + (-end) % 8] = 0  # the alignment gap: the same persons always pack into the same bytes
        # mode="wrap": the indices are in range by construction, and "raise" would copy through a buffer
        columns[name] = np.take(c[f.name], idx, out=buf[off:end].view(dtype), mode="wrap")
    out: dict[str, Any] = {
        "packed": buf,
        "fields": tuple(fields),
        "width": _padded_width(columns["lengths"], ds.pad_multiple),
    }
    if "n_targets" in columns:
        out["targets_width"] = int(columns["n_targets"].max(initial=0))
    return out


def collate_padded(block: Block, ds: ShardedDataset) -> dict[str, torch.Tensor]:
    """Pad the ragged fields to the batch's longest (a multiple of pad_multiple) or to pad_to, keep narrow dtypes;
    stamps stored once per run are repeated over their tokens first."""
    c = expand_runs(block, ds.schema).columns
    lengths = c["length"].astype(np.int64)
    if ds.pad_to is not None:
        width = ds.pad_to
        keep = np.minimum(lengths, width)
        if ds.offline_mlm and (lengths > width).any():
            i = int(np.argmax(lengths > width))
            raise ValueError(f"{ds.root}: person {int(c['person_id'][i])} has {int(lengths[i])} tokens, more than "
                             f"pad_to={width}: cropping would lose tokens that its offline MLM targets point to; "
                             "set pad_to to at least the longest person (the seed's 512), or leave it unset")
    else:
        width = _padded_width(lengths, ds.pad_multiple)
        keep = lengths
    out: dict[str, torch.Tensor] = {"person_id": torch.from_numpy(np.ascontiguousarray(c["person_id"])),
                                    "lengths": torch.from_numpy(keep.astype(np.int32))}
    masks = {"length": _prefix_mask(keep, width)}
    src_masks = {"length": _prefix_mask(lengths, int(lengths.max(initial=0)))} if ds.pad_to is not None else None
    if "n_targets" in c:
        nt = c["n_targets"].astype(np.int64)
        masks["n_targets"] = _prefix_mask(nt, int(nt.max(initial=0)))
    for f in token_schema(ds.schema):
        if f.name in ("person_id", "length"):
            continue
        col = c[f.name]
        if f.kind == SCALAR:
            out[f.name] = torch.from_numpy(np.ascontiguousarray(col))
            continue
        m = masks[COUNT_OF[f.kind]]
        arr = np.zeros(m.shape, dtype=col.dtype)
        if f.kind == RAGGED and src_masks is not None:  # crop: drop values past pad_to
            full = np.zeros(src_masks["length"].shape, dtype=col.dtype)
            full[src_masks["length"]] = col
            arr[:, : min(width, full.shape[1])] = full[:, :width]
        else:
            arr[m] = col
        out[f.name] = torch.from_numpy(arr)
    return out


def _padded_width(lengths: np.ndarray, multiple: int) -> int:
    """The batch's longest sequence rounded up to a multiple of ``multiple`` (at least one slot)."""
    return int(-(-max(1, int(lengths.max(initial=1))) // multiple) * multiple)


def _prefix_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] < lengths[:, None]


def _as_is(batch: Any) -> Any:
    return batch


def _quiet_lightning_len_warning() -> None:
    """Lightning warns that the ``__len__`` of any loader over an IterableDataset "could be inaccurate"; this
    loader's is exact (each rank's count from the plan, tested). Python's filters cannot tell loaders apart, so the
    filter is as narrow as they allow: that one message, from Lightning's ``utilities.data`` (either package), only
    in a process that has built a ShardedLoader (adding it again replaces it: no duplicates)."""
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined",
                            module=r"(lightning\.pytorch|pytorch_lightning)\.utilities\.data")


class _WorkerContext(multiprocessing.context.ForkServerContext):
    """Workers start from a clean forkserver process, not forked from a training process whose thread pools, gloo
    threads or pin-memory thread may hold a lock at the moment of the fork (a rare, random deadlock of the new
    worker: pytorch/pytorch#130610). The server imports torch and this module once, so a worker starts in a
    fraction of a second. Like spawn, it needs the training script's ``if __name__ == "__main__":`` guard; pass
    ``multiprocessing_context="fork"`` to ShardedLoader to choose otherwise.

    Its queues' pipes hold 1 MiB instead of 64 KiB, so a packed batch (~200 KB for 256 persons) crosses from a
    worker in one write and one read, not in six handovers that hold the queue's lock against the other workers
    (docs/performance.md, changes 8 and 9)."""

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802 (multiprocessing's name)
        queue = super().Queue(maxsize)
        with contextlib.suppress(OSError, AttributeError):  # not Linux, or a lower pipe-max-size: keep 64 KiB
            fcntl.fcntl(queue._reader.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return queue


def _worker_context() -> multiprocessing.context.BaseContext:
    ctx = _WorkerContext()
    ctx.set_forkserver_preload(["torch", "webdataset", __name__])
    return ctx


class ShardedLoader(DataLoader):
    """A DataLoader that keeps the dataset's worker count in step, numbers the epochs and can resume exactly.

    ``state_dict()`` / ``load_state_dict()`` make it a Lightning stateful loader: a run stopped after n batches and
    resumed yields exactly the batches it had not yet yielded. A changed dataset is refused.

    Workers send ``batches_per_message`` batches per item (default: about 4,096 persons through the rings below,
    1,024 through the pipe, which then holds a message whole), which this loader hands out one at a time: the main
    process's cost per item (the DataLoader's bookkeeping, the index queue, the pipe, unpickling) is paid once per
    message, and it competes with the workers for the node's cores.

    Packed batches cross from the workers through shared memory: each worker writes them into a ring of
    ``ring_bytes`` (default: the bytes of the batches in flight, ~20 MB per worker at batch 256 and a 4,096-person
    window) and this loader copies each one out once (into pinned memory when ``pin_memory``) as it arrives.
    ``ring_bytes=0``, or a ``/dev/shm`` with less than twice the rings' size free (with a warning), sends them
    through the pipes instead.
    """

    def __init__(self, dataset: ShardedDataset, num_workers: int | None = None, *,
                 batches_per_message: int | None = None, ring_bytes: int | None = None, **kwargs: Any) -> None:
        if num_workers is not None and num_workers != dataset.num_workers:
            raise ValueError(f"num_workers={num_workers} but the dataset was built for {dataset.num_workers}")
        if not kwargs.get("in_order", True):
            raise ValueError("ShardedLoader needs in_order=True: exact resume and the workers' rings rely on each "
                             "worker's batches coming back in the order it made them")
        if batches_per_message is None:  # from the arguments alone, so that a resumed run gets the same value
            rings = dataset.packed and ring_bytes != 0
            persons = RING_MESSAGE_PERSONS if rings else PIPE_MESSAGE_PERSONS
            batches_per_message = max(1, persons // dataset.batch_size)
        if batches_per_message < 1:
            raise ValueError(f"batches_per_message must be >= 1, not {batches_per_message}")
        dataset.batches_per_message = batches_per_message if dataset.num_workers else 1
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        if dataset.num_workers:
            kwargs.setdefault("persistent_workers", True)
            # a worker stops yielding while it loads its next window (a burst of decompression), and the in-order
            # DataLoader then waits for it while the other workers idle: keep a window's batches in flight
            window_messages = -(-dataset.window // (dataset.batch_size * dataset.batches_per_message))
            kwargs.setdefault("prefetch_factor", min(MAX_PREFETCH, window_messages + 2))
            kwargs.setdefault("multiprocessing_context", _worker_context())
        # identity collate: DataLoader's default would turn the packed numpy buffer into a tensor inside the worker
        kwargs.setdefault("collate_fn", _as_is)
        super().__init__(dataset, batch_size=None, num_workers=dataset.num_workers, **kwargs)
        if ring_bytes is None:
            in_flight = (self.prefetch_factor or 0) + 2  # messages: the DataLoader's, and the two being made or read
            ring_bytes = in_flight * dataset.batches_per_message * dataset.batch_size * RING_PERSON_BYTES
        self.ring_bytes = ring_bytes if dataset.num_workers and dataset.packed else 0
        self._epoch = 0
        self._yielded = 0
        _quiet_lightning_len_warning()
        self._live: object | None = None  # the pass under way (begun, not finished): its position cannot move

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        ds._owner = os.getpid()  # before the workers start: they exit with this process
        self._epoch = ds.next_epoch()
        self._yielded = int(ds._ctl[1]) if int(ds._ctl[2]) == 0 else 0
        rings = self._start_rings()
        iteration = 0
        if rings is not None:
            iteration = int(rings.ctl[0]) + 1
            rings.ctl[0] = iteration  # before the DataLoader restarts the workers' passes: older passes stop waiting
        items = super().__iter__()
        self._live = this_pass = object()
        try:
            for item in items:
                group = item if isinstance(item, list) else [item]
                self._take_buffers(group, rings)
                for batch in group:
                    self._yielded += 1
                    yield batch
        finally:
            # exhausted or abandoned: this pass's workers stop waiting for ring space (unless a newer iteration took
            # over) before the DataLoader's iterator goes, since without persistent workers it then joins them
            if rings is not None and int(rings.ctl[0]) == iteration:
                rings.ctl[0] = iteration + 1
            if self._live is this_pass:  # a later pass may have begun before this one was closed
                self._live = None
            del items

    def _start_rings(self) -> RingViews | None:
        """The workers' rings, made afresh for workers about to start (persistent workers keep theirs)."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if not self.ring_bytes:
            return None
        if ds.rings is None or not self.persistent_workers:
            need = ds.num_workers * self.ring_bytes
            free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else None
            if free is not None and free < 2 * need:
                warnings.warn(f"{SHM_DIR} has {free >> 20} MiB free, less than twice the workers' rings ({need >> 20} "
                              "MiB): batches go through the workers' pipes instead, which costs the training process "
                              "more CPU. Give the container more shared memory (docker run --shm-size).", stacklevel=3)
                self.ring_bytes = 0
                return None
            ds.rings = torch.zeros((ds.num_workers, self.ring_bytes), dtype=torch.uint8).share_memory_()
            ds.ring_ctl = torch.zeros(1 + ds.num_workers, dtype=torch.int64).share_memory_()
        assert ds.ring_ctl is not None
        return RingViews(ds.rings.numpy(), ds.ring_ctl.numpy())

    def _take_buffers(self, group: list[dict[str, Any]], rings: RingViews | None) -> None:
        """Each packed buffer as a tensor of its own (pinned when ``pin_memory``): copied out of its worker's ring,
        whose bytes are then released, or taken from the pipe's copy."""
        released: dict[int, int] = {}
        for batch in group:
            packed = batch.get("packed")
            if isinstance(packed, RingSlot):
                assert rings is not None
                out = torch.empty(packed.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
                # numpy's copy: torch's would split a large copy over intra-op threads that compete with the workers
                out.numpy()[:] = rings.data[packed.worker, packed.offset : packed.offset + packed.nbytes]
                batch["packed"] = out
                released[packed.worker] = packed.end
            elif isinstance(packed, np.ndarray):
                buf = torch.from_numpy(packed)
                batch["packed"] = buf.pin_memory() if self.pin_memory else buf
        if released:
            assert rings is not None
            for worker, end in released.items():
                rings.ctl[1 + worker] = end

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it returned so far) of the current or last pass."""
        return self._epoch, self._yielded

    def state_dict(self, epoch_batches: int | None = None,
                   position: tuple[int, int] | None = None) -> dict[str, Any]:
        """Where the next pass starts. ``epoch_batches``: the batches an epoch ends after when the consumer stops
        early (Lightning's ``limit_train_batches``); default ``len(self)``. ``position``: (epoch, batches) as of the
        batch the consumer uses now, when it has taken more (a prefetcher's batches built ahead, which the resumed
        pass returns again); default :attr:`position`."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        epoch, consumed = self.position if position is None else position
        done = consumed >= (len(ds) if epoch_batches is None else epoch_batches)
        return {
            "fingerprint": ds.fingerprint,
            "split": ds.split,
            "epoch": epoch + 1 if done else epoch,
            "batches": 0 if done else consumed,
            "layout": self._layout(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass where ``state`` says. Refused once a pass has begun: its workers already read on."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if self._live is not None:
            raise RuntimeError(
                f"{ds.root}: load_state_dict() after this loader began a pass ({self._yielded} batches into epoch "
                f"{self._epoch}): resuming now would replay or skip batches. Load the state before iterating "
                "(LifeSeqDataModule does, whenever Lightning builds the loader)")
        if state["fingerprint"] != ds.fingerprint:
            raise DatasetChanged(
                f"{ds.root}: dataset fingerprint {ds.fingerprint} differs from the checkpoint's {state['fingerprint']}"
                ": the data changed since the checkpoint, so its position in the epoch means nothing here"
            )
        now, then = self._layout(), state["layout"]
        missing = [k for k in now if k not in then]
        if missing:
            raise ValueError(f"cannot resume exactly: the checkpoint's loader state does not record "
                             f"{', '.join(missing)} (saved by an older lifeseq_shards), so it may have read in another "
                             "order; resume without the loader's state to start its epoch over")
        changed = [f"{k} {then[k]!r} -> {now[k]!r}" for k in now if then[k] != now[k]]
        if changed:
            raise ValueError(f"cannot resume exactly: {'; '.join(changed)} since the checkpoint (another split, or "
                             "another order of its persons)")
        ds.resume_at(int(state["epoch"]), int(state["batches"]))
        self._epoch, self._yielded = int(state["epoch"]), int(state["batches"])

    def _layout(self) -> dict[str, Any]:
        """Every setting that decides which persons a position in the epoch holds: a state resumes only into the
        same (``window`` = max(window_persons, window_shards x the largest shard's persons))."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        return {"split": [ds.split] if isinstance(ds.split, str) else list(ds.split), "world_size": ds.world_size,
                "num_workers": ds.num_workers, "batch_size": ds.batch_size, "seed": ds.seed, "mode": ds.mode,
                "shuffle": ds.shuffle, "drop_last": ds.drop_last, "window": ds.window,
                "batches_per_message": ds.batches_per_message}
