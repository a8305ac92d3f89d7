"""A host-bound function of tensors replayed as CUDA graphs (:class:`GraphedFunction`): captured once per input
shapes and constants, then each call is a few copies in, one graph launch and a copy out, instead of the hundreds of
kernel launches it takes eagerly. For functions with no host sync and no randomness of torch's, like the masker.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

MAX_GRAPHS = 8


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the captured kernels read these: each call copies its arguments into them
    outputs: dict[str, torch.Tensor]  # and write these, in the graphs' shared pool: overwritten by the next replay


class GraphedFunction:
    """``fn(*args)``, where ``args`` are tensors and hashable constants and ``fn`` returns a dict of tensors, run as a
    CUDA graph on CUDA tensors and eagerly elsewhere; the same results either way.

    One graph per (shapes, dtypes, device) of the tensors and values of the constants: a new constant (the epoch,
    for the masker) drops the graphs of the old one. Past :data:`MAX_GRAPHS` shapes for one set of constants (a padded
    layout without a fixed width gives each batch its own), new shapes run eagerly, with one warning. The outputs
    are copies, so a later call does not overwrite them; every replay waits for the previous one to finish (they
    share inputs and a memory pool), whichever stream makes it, and calls from two threads (a prefetch thread and the
    validation loop) take turns. A graph captured under ``torch.inference_mode`` (Lightning's validation) replays
    outside it too. Capturing synchronises the device, once per graph, and so does a change of constants.
    """

    def __init__(self, fn: Callable[..., dict[str, torch.Tensor]]) -> None:
        self.fn = fn
        self._graphs: dict[Hashable, _Graph] = {}
        self._constants: tuple[Any, ...] | None = None
        self._pool: Any = None
        self._done: torch.cuda.Event | None = None
        self._capture_stream: torch.cuda.Stream | None = None  # its own: never a stream that NCCL or a step uses
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, *args: Any) -> dict[str, torch.Tensor]:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or tensors[0].device.type != "cuda":
            return self.fn(*args)
        with self._lock:
            return self._replay(args, tensors)

    def _replay(self, args: tuple[Any, ...], tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        constants = tuple(a for a in args if not isinstance(a, torch.Tensor))
        if constants != self._constants:
            if self._done is not None:
                self._done.synchronize()  # the last replay has finished before its graph's memory is given back
            self._graphs.clear()
            self._pool = None  # the cleared graphs were its only users: a new one for the next captures
            self._constants = constants
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) >= MAX_GRAPHS:
                if not self._warned:
                    warnings.warn(f"{len(self._graphs)} input shapes captured already: further shapes run eagerly "
                                  "(give the batches a fixed width, e.g. pad_to, to replay one graph)", stacklevel=2)
                    self._warned = True
                return self.fn(*args)
            graph = self._graphs[key] = self._capture(args)
        stream = torch.cuda.current_stream(tensors[0].device)
        if self._done is not None:
            stream.wait_event(self._done)
        for static, value in zip(graph.inputs, tensors, strict=True):
            static.copy_(value)
        graph.graph.replay()
        out = {k: v.clone() for k, v in graph.outputs.items()}
        self._done = torch.cuda.Event()
        self._done.record(stream)
        return out

    def _capture(self, args: tuple[Any, ...]) -> _Graph:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        # normal tensors even under inference_mode, so that a replay outside it can copy into them
        with torch.inference_mode(False), torch.cuda.device(device):
            static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            current = torch.cuda.current_stream(device)
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(device, priority=-1)  # not the pool NCCL's streams use
            self._capture_stream.wait_stream(current)
            with torch.cuda.stream(self._capture_stream):
                self.fn(*static)  # lazy initialisations (workspaces, handles) must not happen inside the capture
            current.wait_stream(self._capture_stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the training thread may launch its step while a prefetch thread captures
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                outputs = self.fn(*static)
        return _Graph(graph, [a for a in static if isinstance(a, torch.Tensor)], outputs)
