"""Partition math for DDP reading: which persons each (rank, worker) slot reads, in which order, and how many batches.

Under DDP with R ranks and K DataLoader workers per rank, N = R * max(K, 1) *slots* read disjoint parts of a split
without talking to each other. Two invariants make this safe:

* every rank yields the same number of batches, otherwise the gradient all-reduce of the longer ranks hangs;
* every person is read at most once per epoch (exactly once in inference, where nothing may be dropped).

Training shards all hold the same number n of persons, so whole shards dealt round-robin give every slot the same
budget; the S % N shards that do not go round evenly are pooled and cut into N equal slices, and the few persons that
still do not divide (fewer than N) are left out for this epoch only - the shard order changes with the epoch, so a
different tail is left out each time. Everything here is a pure function of its arguments (no I/O, no global RNG), so
all slots compute the same plan independently and a resumed run recomputes it exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

TRAIN, INFERENCE = "train", "inference"
# Constant tags mixed into the RNG seeds so the shard order and the window shuffles never share a stream.
_ORDER_TAG = 0x4F524452  # "ORDR"
_WINDOW_TAG = 0x57494E44  # "WIND"
_MAX_SLOT_LINES = 16
_MAX_SEGMENTS_SHOWN = 6


@dataclass(frozen=True)
class Segment:
    """Persons [start, stop) of shard number `shard` (an index into the shard_sizes list the plan was made from)."""

    shard: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _check_topology(world_size: int, num_workers: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


def num_slots(world_size: int, num_workers: int) -> int:
    """Independent readers: K=0 means the rank's main process reads, which still counts as one slot."""
    _check_topology(world_size, num_workers)
    return world_size * max(num_workers, 1)


def slot_index(rank: int, worker: int, num_workers: int) -> int:
    """Rank-major numbering, so a rank's slots are contiguous: slots [rank*K, (rank+1)*K)."""
    k = max(num_workers, 1)
    if rank < 0 or not 0 <= worker < k:
        raise ValueError(f"rank {rank} / worker {worker} out of range for num_workers={num_workers}")
    return rank * k + worker


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(num_shards) that depends only on (seed, epoch), so every slot derives the same one."""
    return np.random.default_rng([seed, epoch, _ORDER_TAG]).permutation(num_shards)


def _train_size(shard_sizes: Sequence[int]) -> int:
    """The common shard size n; training balance relies on it, so unequal sizes are an error, not a warning."""
    if not shard_sizes:
        raise ValueError("train mode needs at least one shard")
    sizes = set(shard_sizes)
    if len(sizes) != 1:
        raise ValueError(f"train shards must all hold the same number of persons, got sizes {sorted(sizes)}")
    n = sizes.pop()
    if n < 0:
        raise ValueError(f"shard size must be >= 0, got {n}")
    return n


def _pool_slice(pool: Sequence[int], n: int, start: int, stop: int) -> list[Segment]:
    """Pool positions [start, stop) as segments; the pool is the concatenation of shards `pool`, n persons each."""
    segments = []
    pos = start
    while pos < stop:
        i, offset = divmod(pos, n)
        take = min(n - offset, stop - pos)
        segments.append(Segment(int(pool[i]), offset, offset + take))
        pos += take
    return segments


def assign(
    shard_sizes: Sequence[int],
    world_size: int,
    num_workers: int,
    *,
    mode: str,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[list[Segment]]:
    """The segments each slot reads, in reading order; list index = slot_index(rank, worker, num_workers).

    train: equal shards; whole shards round-robin, then an equal slice of the pooled tail shards per slot.
    inference: any sizes (the remainder shard last); slot j reads whole shards j, j+N, ... - nothing is dropped,
    slot counts may differ.
    """
    slots = num_slots(world_size, num_workers)
    if mode == INFERENCE:
        if any(size < 0 for size in shard_sizes):
            raise ValueError(f"shard sizes must be >= 0, got {list(shard_sizes)}")
        return [[Segment(s, 0, int(shard_sizes[s])) for s in range(j, len(shard_sizes), slots)] for j in range(slots)]
    if mode != TRAIN:
        raise ValueError(f"mode must be {TRAIN!r} or {INFERENCE!r}, got {mode!r}")
    n = _train_size(shard_sizes)
    num_shards = len(shard_sizes)
    order = epoch_shard_order(num_shards, seed, epoch) if shuffle else np.arange(num_shards)
    whole = num_shards // slots * slots
    pool = order[whole:]
    q = len(pool) * n // slots
    return [
        [Segment(int(s), 0, n) for s in order[j:whole:slots]] + _pool_slice(pool, n, j * q, (j + 1) * q)
        for j in range(slots)
    ]


def left_out(shard_sizes: Sequence[int], world_size: int, num_workers: int, mode: str) -> int:
    """Persons no slot reads this epoch: (r*n) % N in train (always < N), 0 in inference."""
    slots = num_slots(world_size, num_workers)
    if mode == INFERENCE:
        return 0
    if mode != TRAIN:
        raise ValueError(f"mode must be {TRAIN!r} or {INFERENCE!r}, got {mode!r}")
    n = _train_size(shard_sizes)
    return len(shard_sizes) % slots * n % slots


def slot_persons(segments: list[Segment]) -> int:
    return sum(seg.size for seg in segments)


def num_batches(persons: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches one slot yields: a slot batches only its own persons, so a short tail batch is per slot."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return persons // batch_size if drop_last else -(-persons // batch_size)


def rank_batches(
    shard_sizes: Sequence[int],
    world_size: int,
    num_workers: int,
    batch_size: int,
    *,
    mode: str,
    drop_last: bool = False,
) -> list[int]:
    """Batches per rank (sum over its slots). Slot budgets do not depend on the shard order, hence not on seed/epoch."""
    plan = assign(shard_sizes, world_size, num_workers, mode=mode, shuffle=False)
    return _per_rank([num_batches(slot_persons(segments), batch_size, drop_last) for segments in plan], num_workers)


def _per_rank(per_slot: list[int], num_workers: int) -> list[int]:
    """Sum per-slot values over each rank's contiguous block of slots."""
    k = max(num_workers, 1)
    return [sum(per_slot[start : start + k]) for start in range(0, len(per_slot), k)]


def window_order(total: int, window: int, seed: int, epoch: int, slot: int, window_index: int) -> np.ndarray:
    """Stream positions of window `window_index`, shuffled; needs nothing from other windows, so resuming is cheap."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    start = window_index * window
    if not 0 <= start < total:
        raise ValueError(f"window {window_index} is outside a stream of {total} positions (window {window})")
    rng = np.random.default_rng([seed, epoch, slot, window_index, _WINDOW_TAG])
    return start + rng.permutation(min(window, total - start))


def window_permutation(total: int, window: int, seed: int, epoch: int, slot: int) -> np.ndarray:
    """The order in which a slot yields its `total` persons: each window of stream positions shuffled on its own."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    parts = [window_order(total, window, seed, epoch, slot, w) for w in range(-(-total // window))]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def batch_positions(b: int, batch_size: int, total: int) -> range:
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


def coverage(plan: list[list[Segment]]) -> tuple[int, int]:
    """(persons read, distinct (shard, person) positions read); the two are equal iff no position is read twice."""
    by_shard: dict[int, list[Segment]] = {}
    for seg in (seg for segments in plan for seg in segments):
        by_shard.setdefault(seg.shard, []).append(seg)
    read = distinct = 0
    for segments in by_shard.values():
        reach = 0
        for seg in sorted(segments, key=lambda s: s.start):
            read += seg.size
            distinct += max(0, seg.stop - max(seg.start, reach))
            reach = max(reach, seg.stop)
    return read, distinct


@dataclass
class PlanReport:
    ok: bool
    text: str


def _segments_text(segments: list[Segment], shard_sizes: Sequence[int]) -> str:
    """'#3 #7 #9[0:40)': whole shards by number, partial ones with their person range."""
    items = [
        f"#{seg.shard}" if seg.size == shard_sizes[seg.shard] else f"#{seg.shard}[{seg.start}:{seg.stop})"
        for seg in segments
    ]
    if len(items) > _MAX_SEGMENTS_SHOWN:
        items = items[: _MAX_SEGMENTS_SHOWN - 1] + [f"... +{len(items) - _MAX_SEGMENTS_SHOWN + 1} more"]
    return " ".join(items) or "-"


def _span(values: Iterable[int]) -> str:
    """'5' when all values agree, else '4-5'."""
    values = list(values)
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def describe(
    shard_sizes: Sequence[int],
    remainder: int,
    nodes: int,
    gpus: int,
    workers: int,
    batch_size: int,
    *,
    drop_last: bool = False,
    seed: int = 0,
) -> PlanReport:
    """The epoch-0 training plan as `shardify plan` prints it, with a check of its invariants and a verdict.

    ok is True only when the worker count divides the shards exactly (N | S): every slot then reads whole shards and
    nothing is left out.
    """
    world = nodes * gpus
    slots = num_slots(world, workers)
    k = max(workers, 1)
    num_shards = len(shard_sizes)
    plan = assign(shard_sizes, world, workers, mode=TRAIN, seed=seed, epoch=0)
    persons = [slot_persons(segments) for segments in plan]
    batches = [num_batches(p, batch_size, drop_last) for p in persons]
    per_rank = _per_rank(batches, workers)
    total = sum(shard_sizes)
    dropped = left_out(shard_sizes, world, workers, TRAIN)
    read, distinct = coverage(plan)

    lines = [
        f"train split: {num_shards} shards x {shard_sizes[0]} persons = {total}; remainder shard: {remainder} persons "
        "(inference only)",
        f"{nodes} node(s) x {gpus} GPU(s) = {world} ranks; {workers} worker(s) per rank -> {slots} slots; "
        f"batch {batch_size}{' (drop_last)' if drop_last else ''}; epoch 0, seed {seed}",
        "",
        f"{'rank':>5} {'worker':>6} {'slot':>5} {'persons':>8} {'batches':>8}  shards",
    ]
    shown = range(min(slots, _MAX_SLOT_LINES))
    for j in shown:
        worker = str(j % k) if workers else "-"
        lines.append(
            f"{j // k:>5} {worker:>6} {j:>5} {persons[j]:>8} {batches[j]:>8}  {_segments_text(plan[j], shard_sizes)}"
        )
    if slots > len(shown):
        rest = range(len(shown), slots)
        lines.append(
            f"  ... {len(rest)} more slots: {_span(persons[j] for j in rest)} persons, "
            f"{_span(batches[j] for j in rest)} batches each"
        )
    equal = min(per_rank) == max(per_rank)
    lines += [
        "",
        f"batches per rank: {_span(per_rank)}" + (" (all equal)" if equal else " (UNEQUAL: the all-reduce would hang)"),
        f"coverage: {distinct} distinct (shard, person) positions read, {read} reads, "
        f"{'no overlap' if read == distinct else f'{read - distinct} OVERLAPPING'}; "
        f"{distinct} read + {dropped} left out = {distinct + dropped} of {total}",
    ]
    if persons[0] == 0:
        lines.append(f"WARNING: {slots} slots for {total} persons - every slot reads nothing")
    ok = num_shards % slots == 0 and equal and read == distinct and distinct + dropped == total
    if num_shards % slots:
        fits = [w for w in range(1, 17) if num_shards % (world * w) == 0]
        loss = (
            f"{dropped} persons per epoch are left out (which ones changes with the epoch's shard order)"
            if dropped
            else "nothing is left out, but those shards are split between slots"
        )
        lines += [
            "",
            f"NOT EXACT: {num_shards} shards do not divide into {slots} slots ({num_shards} % {slots} = "
            f"{num_shards % slots} shards pooled and sliced); {loss}.",
            f"worker counts in 1..16 that divide exactly for {nodes} x {gpus}: "
            + (", ".join(map(str, fits)) if fits else f"none (reshard to a multiple of {world} x workers shards)"),
        ]
    elif ok:
        lines += ["", f"EXACT: every slot reads {num_shards // slots} whole shard(s); nothing is left out."]
    return PlanReport(ok=ok, text="\n".join(lines))
