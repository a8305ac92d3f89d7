"""The model's batches built one step ahead of the training step (:class:`DevicePrefetcher`), so their copy,
padding and masking leave the step's critical path: on a side CUDA stream, and optionally launched from a background
thread. Batch building itself is :mod:`lifeseq_shards.device.build`'s; this module only schedules it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

# When the model's batches are built: each as it is handed out, on the current stream ("off"); one step ahead on a
# side CUDA stream ("stream"); and launched from a background thread as well ("thread").
OFF, STREAM, THREAD = "off", "stream", "thread"
PREFETCH = (OFF, STREAM, THREAD)


def prefetch_choice(prefetch: str | bool | None) -> str | None:
    """The front ends' ``prefetch`` as one of :data:`PREFETCH`, or None (the default: :data:`STREAM` on CUDA, else
    :data:`OFF`; :func:`on_device`). ``True`` and ``False`` say :data:`STREAM` and :data:`OFF` (the guides' words)."""
    if prefetch is None or prefetch in PREFETCH:
        return prefetch  # type: ignore[return-value]
    if isinstance(prefetch, bool):
        return STREAM if prefetch else OFF
    raise ValueError(f"prefetch must be None, True, False or one of {', '.join(map(repr, PREFETCH))}, not "
                     f"{prefetch!r}")


def on_device(prefetch: str | None, device: torch.device) -> str:
    """``prefetch`` (a :func:`prefetch_choice`) on ``device``: the default is :data:`STREAM` on CUDA, else
    :data:`OFF`."""
    if prefetch is not None:
        return prefetch
    return STREAM if device.type == "cuda" else OFF


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

    ``prefetch`` (one of :data:`PREFETCH`): :data:`STREAM` (the default) builds ahead as above. :data:`THREAD` also
    moves the host's share off the step: a background thread takes the loader's batches and launches their
    preparation (a few hundred kernels: milliseconds of host time, docs/results/training-gpu.md), up to two batches
    ahead, while the training thread launches the step; torch releases the GIL while it dispatches, so the two
    overlap. Same batches, same order. Opt-in until a GPU run says it pays (docs/results/training-gpu.md).

    :data:`OFF` builds each batch only when it is handed out, on the current stream: the same batches and positions
    without the prefetch (a plain loop's ``prefetch=False``, as the DataModule's hooks build them).
    """

    def __init__(self, loader: Iterable[Any], build: Callable[[Any], Mapping[str, Any]],
                 device: torch.device | str, prefetch: str = STREAM) -> None:
        if prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {', '.join(map(repr, PREFETCH))}, not {prefetch!r}")
        self.loader, self.build, self.device = loader, build, torch.device(device)
        self.prefetch = prefetch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def position(self) -> Any:
        """The loader's position: as of the batch handed out, not of those built ahead (the loader's
        ``positioned()`` gives each batch its position, which becomes the loader's when it is handed out)."""
        return self.loader.position  # type: ignore[attr-defined]

    def state_dict(self, epoch_batches: int | None = None, unfinished: int = 0) -> dict[str, Any]:
        """The loader's state: as of the batch handed out, since that is where the loader stands."""
        return self.loader.state_dict(epoch_batches, unfinished)  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def _positioned(self) -> Iterator[tuple[dict[str, Any], Any]]:
        """The loader's batches, each with the position it leaves the loader at when handed out (None for a loader
        without ``positioned()``, which keeps no position)."""
        positioned = getattr(self.loader, "positioned", None)
        return positioned() if positioned is not None else ((batch, None) for batch in self.loader)

    dataset = _LoaderAttribute()
    sampler = _LoaderAttribute()
    batch_sampler = _LoaderAttribute()
    worker_init_fn = _LoaderAttribute()
    _iterator = _LoaderAttribute()

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.prefetch != OFF else None
        if self.prefetch == OFF:
            started = (((self.build(host), None), position) for host, position in self._positioned())
        else:
            started = self._started_in_thread(side) if self.prefetch == THREAD else self._started(side)
        for (batch, ready), position in started:
            if ready is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(ready)
                for value in batch.values():
                    if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                        value.record_stream(current)
            if position is not None:
                self.loader.handed(position)  # type: ignore[attr-defined]
            yield batch

    def _started(self, side: torch.cuda.Stream | None) -> Iterator[tuple[tuple[Mapping[str, Any], Any], Any]]:
        """(batch, its ready event) and the loader's position after it, each started before the previous one is
        handed out: batch i+1's preparation is queued before step i."""
        host = self._positioned()
        ahead = self._start_next(host, side)
        while ahead[0] is not None:
            current, ahead = ahead, self._start_next(host, side)
            yield current

    def _start_next(self, host: Iterator[tuple[Mapping[str, Any], Any]],
                    side: torch.cuda.Stream | None) -> tuple[tuple[Mapping[str, Any], Any] | None, Any]:
        batch, position = next(host, (None, None))
        return self._start(batch, side), position

    def _started_in_thread(self, side: torch.cuda.Stream | None) -> Iterator[tuple[tuple[Mapping[str, Any], Any], Any]]:
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

        host = self._positioned()  # a plain loader's workers start here, from the training thread

        def produce() -> None:
            try:
                with torch.cuda.device(self.device) if side is not None else contextlib.nullcontext():
                    for batch, position in host:  # the CUDA device is per thread: this one's is set above
                        if not put((self._start(batch, side), position)):
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
