"""The model's batches built one step ahead of the training step (:class:`DevicePrefetcher`), so their copy,
padding and masking leave the step's critical path: on a side CUDA stream, and optionally launched from a background
thread. Batch building itself is :mod:`lifeseq_shards.device`'s; this module only schedules it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .deprecation import warn


class _LoaderAttribute:
    """A DataLoader attribute that Lightning reads, or resets at the end of a fit (``_iterator``, to shut the workers
    down), on the train loader: a prefetcher's is its wrapped loader's, so Lightning treats that loader as it treats
    a bare one. Absent where the loader has none (``hasattr`` is Lightning's test)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, prefetcher: Any, owner: type | None = None) -> Any:
        if prefetcher is None:
            return self
        return getattr(prefetcher.loader, self.name)

    def __set__(self, prefetcher: Any, value: Any) -> None:
        setattr(prefetcher.loader, self.name, value)


class DevicePrefetcher:
    """The model's batches built one step ahead: while the step on batch i runs, batch i+1's copy, padding and masking
    run on a side CUDA stream, so they leave the step's critical path on the device.

    Each batch is handed out only after the current stream is made to wait for its side-stream work (an event), and
    its tensors are marked as used by the current stream (``record_stream``), so the allocator does not reuse their
    memory for the side stream's next batch before the step that reads them has run. Off CUDA the same code builds
    each batch on the current (only) timeline: identical batches, nothing overlaps. Sized (``len``), so Lightning
    does not fetch ahead itself; the DataLoader attributes Lightning reads and resets on a train loader are the
    wrapped loader's (:class:`_LoaderAttribute`), anything else is read from :attr:`loader`. Its ``position`` and
    ``state_dict`` (a :class:`~lifeseq_shards.reader.ShardedLoader`'s) are the loader's as of the batch handed out,
    leaving out those built ahead: a checkpoint resumes at the batch the step has not had yet, not one past it.

    ``threaded=True`` also moves the host's share off the step: a background thread takes the loader's batches and
    launches their preparation (a few hundred kernels: milliseconds of host time, docs/tuning.md), up to two
    batches ahead, while the training thread launches the step; torch releases the GIL while it dispatches, so the
    two overlap. Same batches, same order. Opt-in until a GPU run says it pays (docs/tuning.md).

    ``ahead=False`` builds each batch only when it is handed out, on the current stream: the same batches and
    positions without the prefetch (a plain loop's ``prefetch=False``, as the DataModule's hooks build them).
    """

    def __init__(self, loader: Iterable[Any], build: Callable[[Any], Mapping[str, Any]],
                 device: torch.device | str, threaded: bool = False, ahead: bool = True) -> None:
        if threaded and not ahead:
            raise ValueError("DevicePrefetcher(threaded=True) builds batches ahead: it needs ahead=True")
        self.loader, self.build, self.device = loader, build, torch.device(device)
        self.threaded, self.ahead = threaded, ahead
        self._handed: tuple[int, int] | None = None  # the loader's position as of the last batch handed out

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches) of the loader as of the batch the step has, not of those built ahead."""
        return self._handed if self._handed is not None else self.loader.position  # type: ignore[attr-defined]

    def state_dict(self, epoch_batches: int | None = None,
                   position: tuple[int, int] | None = None) -> dict[str, Any]:
        """The loader's state as of ``position`` (default: :attr:`position`, the batch handed out)."""
        return self.loader.state_dict(epoch_batches,  # type: ignore[attr-defined]
                                      position=self.position if position is None else position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._handed = None
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def _loader_position(self) -> tuple[int, int] | None:
        """Read right after the loader returned a batch, in the thread that took it."""
        return self.loader.position if hasattr(self.loader, "position") else None

    dataset = _LoaderAttribute()
    sampler = _LoaderAttribute()
    batch_sampler = _LoaderAttribute()
    worker_init_fn = _LoaderAttribute()
    _iterator = _LoaderAttribute()

    def __getattr__(self, name: str) -> Any:
        # "loader" is not set yet when unpickling: no recursion through __getattr__; a _LoaderAttribute the loader
        # lacks is absent, not deprecated
        if name == "loader" or isinstance(type(self).__dict__.get(name), _LoaderAttribute):
            raise AttributeError(name)
        warn(f"DevicePrefetcher.{name} (the wrapped loader's attribute, reached implicitly)",
             f"DevicePrefetcher.loader.{name}")
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.ahead else None
        if not self.ahead:
            started = (((self.build(host), None), self._loader_position()) for host in self.loader)
        else:
            started = self._started_in_thread(side) if self.threaded else self._started(side)
        for (batch, ready), position in started:
            if ready is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(ready)
                for value in batch.values():
                    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                        value.record_stream(current)
            self._handed = position
            yield batch

    def _started(self, side: torch.cuda.Stream | None) -> Iterator[tuple[tuple[Mapping[str, Any], Any], Any]]:
        """(batch, its ready event) and the loader's position after it, each started before the previous one is
        handed out: batch i+1's preparation is queued before step i."""
        host = iter(self.loader)
        ahead = self._start(next(host, None), side), self._loader_position()
        while ahead[0] is not None:
            current, ahead = ahead, (self._start(next(host, None), side), self._loader_position())
            yield current

    def _started_in_thread(self, side: torch.cuda.Stream | None
                           ) -> Iterator[tuple[tuple[Mapping[str, Any], Any], Any]]:
        """As :meth:`_started`, from a background thread (a daemon); stopping the iteration (the end of
        ``max_steps``) stops the thread within one poll of its full queue, and an error in it is raised here."""
        handed: queue.Queue[Any] = queue.Queue(maxsize=1)
        stop = threading.Event()
        done = object()

        def put(item: Any) -> bool:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    handed.put(item, timeout=0.05)
                    return True
            return False

        host = iter(self.loader)  # started here: a loader's workers are started from the training thread

        def produce() -> None:
            try:
                with torch.cuda.device(self.device) if side is not None else contextlib.nullcontext():
                    for batch in host:  # the CUDA device is per thread: this one's is set above
                        if not put((self._start(batch, side), self._loader_position())):
                            return
                put(done)
            except BaseException as error:  # handed to the training thread, which raises it
                put(error)

        thread = threading.Thread(target=produce, name="device-prefetch", daemon=True)
        thread.start()
        try:
            while (item := handed.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=10)  # it polls `stop` every 50 ms; a loader stuck in its `next` is left behind

    def _start(self, host: Any,
               side: torch.cuda.Stream | None) -> tuple[Mapping[str, Any], torch.cuda.Event | None] | None:
        if host is None:
            return None
        if side is None:
            return self.build(host), None
        with torch.cuda.stream(side):
            batch = self.build(host)
            ready = torch.cuda.Event()
            ready.record(side)
        return batch, ready
