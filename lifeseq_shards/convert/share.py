"""Where each kept person goes, from the persons' ids alone: pass 2's stream of each split, bucket by bucket, and
which part of it a writer writes. Pass 2 cuts the shards along it (:mod:`.passes`), and an array task reads it first
to encode only the persons its shards hold (the rest of the input is only surveyed: ids and lengths).

A bucket's persons are the kept persons whose seeded id hash falls in it, in input order; pass 2 shuffles them with
a generator seeded by (seed, bucket) and appends each split's members to that split's stream. Everything here is a
function of the ids in input order, so every task of an array finds the same streams as a single conversion."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .encode import bucket_of


@dataclass(frozen=True)
class Cut:
    """One bucket's part of one split's stream: its persons' ids in stream order, of which the writer writes
    ``ids[lo:hi]`` (the rest fall outside its shards)."""

    ids: np.ndarray
    lo: int
    hi: int

    @property
    def wanted(self) -> np.ndarray:
        return self.ids[self.lo : self.hi]


def cuts(ids: np.ndarray, members: Mapping[str, np.ndarray], seed: int, buckets: int,
         spans: Mapping[str, tuple[int, int]]) -> Iterator[dict[str, Cut]]:
    """Per bucket, in order: each split's cut. ``ids`` are the kept persons' in input order, ``members`` each
    split's mask over them, ``spans`` each split's [start, end) of its stream that the writer writes."""
    bucket = bucket_of(ids, seed, buckets)
    order = np.argsort(bucket, kind="stable")  # by bucket, in input order within one
    bounds = np.concatenate([[0], np.cumsum(np.bincount(bucket, minlength=buckets))])
    del bucket  # what pass 2 holds a person while it writes: its id, its split masks and its place in ``order``
    if len(ids) < 2**31:
        order = order.astype(np.int32)
    seen = dict.fromkeys(spans, 0)
    for b in range(buckets):
        mine = order[bounds[b] : bounds[b + 1]]
        mine = mine[np.random.default_rng([seed, b, 7]).permutation(len(mine))]
        out = {}
        for name, (start, end) in spans.items():
            stream = ids[mine[members[name][mine]]]
            lo = min(max(start - seen[name], 0), len(stream))
            hi = max(lo, min(max(end - seen[name], 0), len(stream)))
            seen[name] += len(stream)
            out[name] = Cut(stream, lo, hi)
        yield out


def selection(ids: np.ndarray, per_task: list[int], wanted: np.ndarray) -> list[np.ndarray]:
    """Per input task (``per_task``: its kept persons, in input order), the sorted ids of those in ``wanted``: what
    that task's encode tokenises."""
    chosen = np.isin(ids, wanted)
    bounds = np.cumsum([0, *per_task])
    return [np.sort(ids[a:b][chosen[a:b]]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
