"""The loader: a DataLoader that keeps the dataset's worker count in step, owns the workers' rings and message size
(handed to the dataset as one :class:`WorkerLink`), copies packed batches out of the rings, and saves and restores
its position (its checkpoint state)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..device.batch import HostBatch, PackedBatch
from ..plan.resume import Position
from .dataset import ShardedDataset
from .mainguard import refuse_a_main_script_from_stdin, refuse_an_unguarded_main
from .state import (
    START_OVER,
    DatasetChanged,
    EpochReadChanged,
    arrangement_changes,
    budget_changes,
    kept_changes,
    read_state,
    saved_arrangement,
    saved_state,
)
from .transport import RingEntry, RingReader, WorkerLink, worker_context

MAX_PREFETCH = 64  # messages in flight per worker, at most
# Persons per worker message; the main process pays the DataLoader's per-item costs once per message. Through the
# rings only ring entries cross the pipe; through the pipe a message crosses in one write only if the pipe holds it.
RING_MESSAGE_PERSONS = 4096
PIPE_MESSAGE_PERSONS = 1024
RING_PERSON_BYTES = 1024  # ring bytes per person in flight: above a packed person, offline MLM fields included
SHM_DIR = "/dev/shm"


def _as_is(batch: Any) -> Any:
    return batch


def _quiet_lightning_len_warning() -> None:
    """Lightning warns that the ``__len__`` of any loader over an IterableDataset "could be inaccurate"; this
    loader's is exact (each rank's count from the plan, tested). Python's filters cannot tell loaders apart, so the
    filter is as narrow as they allow: that one message, from Lightning's ``utilities.data`` (either package), only
    in a process that has built a ShardedLoader (adding it again replaces it: no duplicates)."""
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined",
                            module=r"(lightning\.pytorch|pytorch_lightning)\.utilities\.data")


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
            batches_per_message = max(1, persons // dataset.batch_persons)
        if batches_per_message < 1:
            raise ValueError(f"batches_per_message must be >= 1, not {batches_per_message}")
        self._per_message = batches_per_message if dataset.num_workers else 1
        self._rings: RingReader | None = None  # the workers' rings, read from this side
        dataset.attach(self._link())
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        if dataset.num_workers:
            kwargs.setdefault("persistent_workers", True)
            # a worker stops yielding while it loads its next window (a burst of decompression), and the in-order
            # DataLoader then waits for it while the other workers idle: keep a window's batches in flight
            window_messages = -(-dataset.window // (dataset.batch_persons * self._per_message))
            kwargs.setdefault("prefetch_factor", min(MAX_PREFETCH, window_messages + 2))
            if "multiprocessing_context" not in kwargs:  # not built otherwise: it sets the forkserver's preload
                kwargs["multiprocessing_context"] = worker_context()
        # identity collate: DataLoader's default would turn the packed numpy buffer into a tensor inside the worker
        kwargs.setdefault("collate_fn", _as_is)
        super().__init__(dataset, batch_size=None, num_workers=dataset.num_workers, **kwargs)
        if dataset.num_workers:  # whichever context the caller named
            refuse_a_main_script_from_stdin(self._start_method())
        if ring_bytes is None:
            in_flight = (self.prefetch_factor or 0) + 2  # messages: the DataLoader's, and the two being made or read
            ring_bytes = in_flight * self._per_message * dataset.batch_persons * RING_PERSON_BYTES
        self.ring_bytes = ring_bytes if dataset.num_workers and dataset.packed else 0
        self._position = dataset.next_position()
        self._start = self._position  # where the pass under way began
        self._loaded = False  # a loaded state whose pass has not begun: set_epoch keeps it, or refuses another epoch
        _quiet_lightning_len_warning()
        self._live: object | None = None  # the pass under way (begun, not finished): its position cannot move

    def _link(self) -> WorkerLink:
        """What this loader's workers need to know, as of now (this process owns them)."""
        if self._rings is None:
            return WorkerLink(self._per_message, None, None, os.getpid())
        return WorkerLink(self._per_message, self._rings.rings, self._rings.ctl, os.getpid())

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch`` from its start (the one after it ``epoch + 1``, ...). After
        :meth:`load_state_dict`, until its pass begins, the loaded position stays when it is in ``epoch`` (a loop's
        ``set_epoch`` at the top of the resumed epoch) and another epoch is refused: it would replay or skip
        batches."""
        if self._loaded:
            at = self._position
            if epoch == at.epoch:
                return
            raise ValueError(f"{self.dataset.root}: the loaded state goes on in epoch {at.epoch} after {at.batches} "
                             f"batches, but set_epoch({epoch}) would start epoch {epoch}: loop from the loaded epoch "
                             "(range(data.epoch, epochs) with LifeSeqData, range(loader.position.epoch, epochs) "
                             "here), or build a new loader to start over")
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        nxt = ds.next_position()
        if (nxt.epoch, nxt.batches, nxt.history) == (epoch, 0, ()):  # the next epoch's start: who it reads stays
            self._position = nxt
        else:
            self._position = Position(epoch, 0)
        at = self._position
        ds.resume_at(at.epoch, at.batches, at.history, at.left_out_before)

    def __iter__(self) -> Iterator[HostBatch]:
        for batch, position in self.positioned():
            self.handed(position)
            yield batch

    def _start_method(self) -> str | None:
        """How the workers start: the context's (the caller's or :func:`worker_context`), else Python's default."""
        context = self.multiprocessing_context
        return context.get_start_method() if context else multiprocessing.get_start_method()

    def positioned(self) -> Iterator[tuple[HostBatch, Position]]:
        """This pass's batches, each with where the epoch stands once it is handed out: for a consumer that takes
        batches ahead of handing them out (:class:`~lifeseq_shards.device.prefetch.DevicePrefetcher`), which reports
        each one handed out with :meth:`handed`, so that :attr:`position` leaves out those taken ahead."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if ds.num_workers:  # workers may be about to start (each pass, unless persistent)
            refuse_an_unguarded_main(self._start_method())
        rings = self._start_rings()
        ds.attach(self._link())  # before the workers start: they exit with this process
        start = ds.next_position()  # as the workers will compute it
        batches = start.batches
        self._position = self._start = start
        self._loaded = False
        iteration = rings.begin() if rings is not None else 0  # before the DataLoader restarts the workers' passes
        items = super().__iter__()
        self._live = this_pass = object()
        try:
            for item in items:
                group = item if isinstance(item, list) else [item]
                self._take_buffers(group, rings)
                for batch in group:
                    batches += 1
                    yield batch, dataclasses.replace(start, batches=batches)
        finally:
            # exhausted or abandoned: this pass's workers stop waiting for ring space (unless a newer iteration took
            # over) before the DataLoader's iterator goes, since without persistent workers it then joins them
            if rings is not None:
                rings.end(iteration)
            if self._live is this_pass:  # a later pass may have begun before this one was closed
                self._live = None
            del items

    def handed(self, position: Position) -> None:
        """A batch of :meth:`positioned` was handed out: the epoch now stands at its ``position``."""
        self._position = position

    def _start_rings(self) -> RingReader | None:
        """The workers' rings, made afresh for workers about to start (persistent workers keep theirs)."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if not self.ring_bytes:
            return None
        if self._rings is None or not self.persistent_workers:
            need = ds.num_workers * self.ring_bytes
            free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else None
            if free is not None and free < 2 * need:
                warnings.warn(f"{SHM_DIR} has {free >> 20} MiB free, less than twice the workers' rings ({need >> 20} "
                              "MiB): batches go through the workers' pipes instead, which costs the training process "
                              "more CPU. Give the container more shared memory (docker run --shm-size).", stacklevel=3)
                self.ring_bytes, self._rings = 0, None  # new workers get no rings: the pipes carry the batches
                return None
            self._rings = RingReader(ds.num_workers, self.ring_bytes)
        return self._rings

    def _take_buffers(self, group: list[HostBatch], rings: RingReader | None) -> None:
        """Each packed buffer as a tensor of its own (pinned when ``pin_memory``): copied out of its worker's ring,
        or taken from the pipe's copy."""
        for i, batch in enumerate(group):
            if not isinstance(batch, PackedBatch):
                continue
            packed = batch.buffer
            if isinstance(packed, RingEntry):
                assert rings is not None
                group[i] = batch.with_buffer(rings.take(packed, self.pin_memory))
            elif isinstance(packed, np.ndarray):
                buf = torch.from_numpy(packed)
                group[i] = batch.with_buffer(buf.pin_memory() if self.pin_memory else buf)

    # -- checkpoint state -------------------------------------------------------------------------------------
    @property
    def position(self) -> Position:
        """Where the epoch stands: as of the last batch handed out of the current or last pass, or where the next
        pass starts once :meth:`set_epoch` or :meth:`load_state_dict` set it. Its ``history`` (only in an epoch
        resumed from another arrangement) holds the arrangements that read the epoch's start, with the batches each
        took."""
        return self._position

    @property
    def pass_start(self) -> Position:
        """Where the pass under way began, else where the next pass begins (after a pass, the next epoch's start;
        after :meth:`load_state_dict`, the loaded position): its ``batches`` are those of the epoch it leaves out."""
        if self._live is not None:
            return self._start
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        return ds.next_position()

    def state_dict(self, epoch_batches: int | None = None, unfinished: int = 0) -> dict[str, Any]:
        """Where the next pass starts. ``epoch_batches``: the batches an epoch ends after when the consumer stops
        early (Lightning's ``limit_train_batches``); default ``len(self)``. ``unfinished``: the last batches handed
        out that the consumer has not trained on (a checkpoint saved inside a step that is trained again on
        resume), which the resumed pass returns again."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        at = self._position
        if not 0 <= unfinished <= at.batches:
            raise ValueError(f"unfinished={unfinished}: the epoch stands at batch {at.batches}")
        resume = dataclasses.replace(at, batches=at.batches - unfinished)
        return saved_state(ds.fingerprint, ds.split, self._arrangement(),
                           ds.after(resume, len(ds) if epoch_batches is None else epoch_batches))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass where ``state`` says: a :meth:`state_dict`, or a checkpoint holding one (a Lightning
        checkpoint, a plain loop's: :func:`~lifeseq_shards.reader.state.find_states`), else refused in one line
        naming the key or value (:class:`~lifeseq_shards.reader.state.StateError`, a ValueError; the format is
        :mod:`~lifeseq_shards.reader.state`'s). Refused once a pass has begun (its workers already read on).
        Saved in another arrangement (ranks, workers, batch size, window, batches per message, drop_last), the pass is
        the rest of the state's epoch: every person it had not trained on once, in equal batches per rank (a
        warning says how many are left out), starting at :attr:`position` in this arrangement's numbering."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        if self._live is not None:
            raise RuntimeError(
                f"{ds.root}: load_state_dict() after this loader began a pass ({self._position.batches} batches into "
                f"epoch {self._position.epoch}): resuming now would replay or skip batches. Load the state before "
                "iterating (LifeSeqDataModule does, whenever Lightning builds the loader)")
        saved = read_state(state, str(ds.root))
        if saved.fingerprint != ds.fingerprint:
            raise DatasetChanged(
                f"{ds.root}: dataset fingerprint {ds.fingerprint} differs from the checkpoint's {saved.fingerprint}"
                ": the data changed since the checkpoint, so its position in the epoch means nothing here"
            )
        now = self._arrangement()
        changed, kept = [*arrangement_changes(now, saved, str(ds.root), ds.mode), *budget_changes(now, saved)], []
        at = saved.position
        if changed and not (at.batches or at.history):  # nothing of the epoch trained on: this arrangement's own epoch
            at = ds.plan.start_in(at, saved.leg.arrangement)  # reading whom the last left out, where it left any out
        elif changed:
            kept = kept_changes(now, saved)
            if kept:  # named: what is refused, not the arrangement (another one alone is resumed)
                raise EpochReadChanged(f"{ds.root}: cannot resume exactly inside epoch {at.epoch}: {'; '.join(kept)} "
                                       "since the checkpoint, and an epoch is read by persons or by a token budget of "
                                       "one balance and crop throughout; resume with the checkpoint's "
                                       "tokens_per_batch, balance and pad_to until the epoch ends, or " + START_OVER)
            at = dataclasses.replace(at, history=(*at.history, saved.leg))
            base, said = ds.plan.rest(at)
            at = dataclasses.replace(at, batches=base)
            warnings.warn(f"{ds.root}: epoch {at.epoch} resumes in another layout ({'; '.join(changed)}): {said}",
                          stacklevel=2)
        ds.resume_at(at.epoch, at.batches, at.history, at.left_out_before)
        self._position = at
        self._loaded = True

    def _arrangement(self) -> dict[str, Any]:
        """This loader's :func:`~lifeseq_shards.reader.state.saved_arrangement`."""
        ds: ShardedDataset = self.dataset  # type: ignore[assignment]
        return saved_arrangement(ds.partition, [ds.split] if isinstance(ds.split, str) else ds.split, self._per_message,
                            **ds.plan.saved_settings())
