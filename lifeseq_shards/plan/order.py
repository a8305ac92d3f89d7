"""In which order a slot yields its persons, and where a resumed pass starts.

A slot's stream (its segments in reading order, :mod:`lifeseq_shards.plan.partition`) is cut into windows of stream
places (:func:`windows`, :func:`window_bounds`, :class:`Window`), each loaded and shuffled on its own
(:func:`window_order`), so a resumed pass loads only the windows it still needs. Where it resumes: which of each
DataLoader worker's batches an in-order DataLoader had already returned (:func:`worker_batches_consumed`), which stream
each worker of the resumed pass plays (:func:`pass_roles`), the epoch of each pass (:func:`pass_start`) and a saved
position (:func:`resume_point`). Pure functions of their arguments (no I/O, no global RNG).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .slots import Segment, _cut, num_batches, slot_persons

# Mixed into the window shuffles' RNG seeds, unlike plan's _ORDER_TAG, so the shard order and the window shuffles
# never share a stream.
_WINDOW_TAG = 0x57494E44  # "WIND"
WINDOW_PERSONS, WINDOW_SHARDS = 4096, 2  # the default shuffle window: the larger of these persons and shards


def default_window(shard_sizes: Sequence[int]) -> int:
    """The persons shuffled together when a reader is given no ``window``: two shards, and never so few persons
    that the shuffle stays local (the reader and ``shardify plan`` both take it from here)."""
    return max(WINDOW_PERSONS, WINDOW_SHARDS * max(shard_sizes, default=1))


def window_order(total: int, window: int, seed: int, epoch: int, slot: int, window_index: int) -> np.ndarray:
    """Stream places of window `window_index`, shuffled; needs nothing from other windows, so resuming is cheap."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    start = window_index * window
    if not 0 <= start < total:
        raise ValueError(f"window {window_index} is outside a stream of {total} places (window {window})")
    return start + _shuffled(min(window, total - start), seed, epoch, slot, window_index)


def _shuffled(size: int, seed: int, epoch: int, slot: int, window_index: int) -> np.ndarray:
    """The order window ``window_index`` of a slot's stream yields its ``size`` persons in (indices into it)."""
    return np.random.default_rng([seed, epoch, slot, window_index, _WINDOW_TAG]).permutation(size)


def window_permutation(total: int, window: int, seed: int, epoch: int, slot: int) -> np.ndarray:
    """The order in which a slot yields its `total` persons: each window of stream places shuffled on its own."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    parts = [window_order(total, window, seed, epoch, slot, w) for w in range(-(-total // window))]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def batch_places(b: int, batch_size: int, total: int) -> range:
    """Indices into the (window-permuted) stream that make batch b."""
    if batch_size < 1 or b < 0:
        raise ValueError(f"need batch_size >= 1 and b >= 0, got batch_size={batch_size}, b={b}")
    return range(min(b * batch_size, total), min((b + 1) * batch_size, total))


def worker_batches_consumed(n: int, num_workers: int, per_worker: list[int], per_message: int = 1) -> list[int]:
    """How many of each worker's batches are among the first n a DataLoader returned (for exact resume).

    A DataLoader (in_order=True, the default) over an IterableDataset returns worker 0's first message, worker 1's
    first, ..., skipping exhausted workers; a message holds ``per_message`` of the worker's batches (its last one
    fewer). After t full rounds worker k has given min(c_k, t * per_message); the n - sum of those leftover batches
    go, in worker order and a message at a time, to the workers that still had more; the last message may be cut.
    """
    if num_workers == 0:
        return [n]
    if len(per_worker) != num_workers:
        raise ValueError(f"per_worker has {len(per_worker)} entries for {num_workers} workers")
    if not 0 <= n <= sum(per_worker):
        raise ValueError(f"{n} batches consumed, but the workers only produce {sum(per_worker)}")
    if per_message < 1:
        raise ValueError(f"per_message must be >= 1, not {per_message}")
    counts = np.asarray(per_worker, dtype=np.int64)
    lo, hi = 0, -(-int(counts.max(initial=0)) // per_message)  # largest t with sum(min(c, t * m)) <= n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid * per_message).sum() <= n:
            lo = mid
        else:
            hi = mid - 1
    taken = np.minimum(counts, lo * per_message)
    extra = n - int(taken.sum())
    for k in np.flatnonzero(counts > taken):
        step = min(per_message, int(counts[k] - taken[k]), extra)
        taken[k] += step
        extra -= step
    return [int(x) for x in taken]


def first_due(consumed: Sequence[int], per_worker: Sequence[int], per_message: int) -> int:
    """The worker whose message an in-order DataLoader returns after ``consumed`` batches: the unfinished one with
    the fewest whole messages returned, the lowest id among equals (round-robin that skips exhausted workers)."""
    due = [(c // per_message, k) for k, (c, total) in enumerate(zip(consumed, per_worker, strict=True)) if c < total]
    return min(due)[1] if due else 0


def pass_roles(skip_total: int, num_workers: int, per_worker: list[int],
               per_message: int = 1) -> list[tuple[int, int]]:
    """(role, batches to skip) of each worker of a pass that resumes after ``skip_total`` batches: worker k reads
    the stream of worker role_k from its batch ``skip`` on. A fresh DataLoader asks worker 0 first, but the batch
    due next may be another worker's, so the roles rotate: the worker asked first plays the one whose batch is due."""
    consumed = worker_batches_consumed(skip_total, num_workers, per_worker, per_message)
    shift = first_due(consumed, per_worker, per_message)
    roles = [(k + shift) % len(per_worker) for k in range(len(per_worker))]
    return [(role, consumed[role]) for role in roles]


def pass_start(epoch: int, resume_skip: int, passes: int) -> tuple[int, int]:
    """(epoch, batches to skip) of a worker's pass after ``passes`` passes since the epoch was set to ``epoch``
    (resuming ``resume_skip`` batches into it): only the first pass resumes; each later one is a whole next epoch."""
    return epoch + passes, resume_skip if passes == 0 else 0


def resume_point(epoch: int, consumed: int, epoch_batches: int) -> tuple[int, int]:
    """(epoch, batches to skip) where the pass after ``consumed`` batches of ``epoch`` resumes: the next epoch's
    start once the epoch's ``epoch_batches`` are all taken."""
    return (epoch + 1, 0) if consumed >= epoch_batches else (epoch, consumed)


@dataclass(frozen=True)
class Window:
    """Window ``index`` of a slot's stream: places [start, stop), loaded and shuffled together, held by
    ``segments`` in stream order."""

    index: int
    start: int
    stop: int
    segments: tuple[Segment[int], ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def windows(segments: Sequence[Segment[int]], window: int, batch_size: int, drop_last: bool,
            skip: int = 0, cut: int | None = None) -> Iterator[Window]:
    """The windows of a slot's stream (``segments`` in reading order) that hold its batches from batch ``skip`` on;
    a resumed pass starts inside the first one, and one with no batch left loads none. Windows of ``window``
    persons from place 0; with ``cut``, a window ends there and the next ones count from it."""
    total = slot_persons(segments)
    first = min(skip * batch_size, total)
    last = min(num_batches(total, batch_size, drop_last) * batch_size, total)
    if first >= last:  # no batch left (resumed at the end, or drop_last leaves none): nothing to load
        return
    for index, lo, hi in window_bounds(total, window, total if cut is None else cut):
        if lo >= last:
            break
        if hi > first:
            yield Window(index, lo, hi, tuple(_cut(segments, lo, hi)))


def window_bounds(total: int, window: int, cut: int) -> Iterator[tuple[int, int, int]]:
    """(index, start, stop) of each window of a stream of ``total`` places: ``window`` at a time up to ``cut``,
    then again from ``cut`` on."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0 <= cut <= total:
        raise ValueError(f"cut {cut} outside a stream of {total} places")
    index = 0
    for lo, hi in ((0, cut), (cut, total)):
        for start in range(lo, hi, window):
            yield index, start, min(start + window, hi)
            index += 1
