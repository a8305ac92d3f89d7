"""Exact mode's cut (validation): every person of a split read once and every rank the same number of batches, as
per-slot run lengths of one stream (:func:`exact_slot_persons`), or a one-line refusal that says what to change.
Pure arithmetic; :func:`lifeseq_shards.plan.partition.slot_streams` cuts the stream at these lengths.
"""

from __future__ import annotations

from .slots import num_slots


def exact_slot_persons(total: int, world_size: int, num_workers: int, batch_size: int) -> list[int]:
    """Persons of each slot in exact mode: all ``total`` persons, each rank ``b`` batches, where b is the fewest
    that hold a rank's share. A rank takes total // R or one more persons; its K slots take b // K or one more
    batches each, every batch full but each slot's last. ValueError, saying what to change, when no cut does it
    (fewer persons than ranks, or a last round too short to give every rank its last batch)."""
    slots = num_slots(world_size, num_workers)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    k = slots // world_size
    b, need = _exact_need(total, world_size, k, batch_size)
    if world_size * need > total:
        raise ValueError(_exact_refusal(total, world_size, k, batch_size, b, need))
    out = []
    for rank in range(world_size):
        persons = total // world_size + (rank < total % world_size)
        batches = [b // k + (w < b % k) for w in range(k)]
        busy = sum(c > 0 for c in batches)
        extra = persons - need  # beyond the least the rank's batches hold, at most B - 1 more per busy slot
        spread = iter(range(busy))
        for c in batches:
            i = next(spread) if c else 0
            out.append((c - 1) * batch_size + 1 + extra // busy + (i < extra % busy) if c else 0)
    return out


def _exact_need(total: int, world_size: int, k: int, batch_size: int) -> tuple[int, int]:
    """(b, the fewest persons b batches on K slots can hold: each slot's batches full but its last, of one)."""
    b = -(-total // (world_size * batch_size))
    busy = min(k, b)
    return b, (b - busy) * batch_size + busy


def _exact_refusal(total: int, world_size: int, k: int, batch_size: int, b: int, need: int) -> str:
    said = (f"{total} persons cannot each be read once with the same number of batches on every one of "
            f"{world_size} ranks ({k} reader(s) a rank) at batch size {batch_size}: a rank's {b} batches hold at "
            f"least {need} persons, {world_size * need} in all")
    if total < world_size:
        return f"{said}; use at most {total} ranks, or a split of at least {world_size} persons"
    fits = [bs for bs in range(1, -(-total // world_size) + 1)
            if world_size * _exact_need(total, world_size, k, bs)[1] <= total]
    below = [bs for bs in fits if bs < batch_size]
    above = [bs for bs in fits if bs > batch_size]
    near = " or ".join(str(bs) for bs in (below[-1:] + above[:1]))
    workers = ", or more workers per rank" if b > k else ""  # a worker more lets a rank's last batch be short
    return f"{said}; use batch size {near}{workers}"
