"""The token-budget epoch's stream: which person each place of it holds, and where its slot edges fall. Pure.

Contract. The epoch's unshuffled stream is the split's shards, remainder included, in
:func:`~lifeseq_shards.plan.partition.epoch_shard_order` (a permutation by (seed, epoch)); its windows of ``window``
consecutive places are each shuffled on their own (:func:`epoch_stream`). A window's shuffle depends only on (seed,
epoch, window index) and its tokens only on its persons, so one slot of the stream (:func:`slot_stream`) is found
from the windows' token sums (:func:`window_tokens`, one pass over the lengths) and the windows it overlaps alone: the
same persons in the same order as the whole stream cut at the slot edges, in a fraction of the work when there are
many slots. Every function here is a function of its arguments alone: every rank and DataLoader worker gets the same
answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .partition import epoch_shard_order

# Mixed into the window shuffles' RNG seeds, unlike order.py's _WINDOW_TAG, so the two plans never share a stream.
_TOKENS_TAG = 0x544F4B42  # "TOKB"
_CHUNK = 1 << 20  # lengths summed at a time by window_tokens (8 MiB as int64)


def stream_offsets(shard_sizes: Sequence[int], seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Each shard's first place in the epoch's unshuffled stream less its first person (split numbering): person p
    of shard s lies at place p + offsets[s]."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    if not shuffle:
        return np.zeros(len(sizes), dtype=np.int64)
    order = epoch_shard_order(len(sizes), seed, epoch)
    first = np.empty(len(sizes), dtype=np.int64)
    first[order] = np.cumsum(sizes[order]) - sizes[order]
    return first - (np.cumsum(sizes) - sizes)


def stream_places(persons: np.ndarray, shard_sizes: Sequence[int], seed: int, epoch: int,
                  shuffle: bool = True) -> np.ndarray:
    """Each person's (split numbering) place in the epoch's unshuffled stream (int64)."""
    persons = np.asarray(persons, dtype=np.int64)
    offsets = stream_offsets(shard_sizes, seed, epoch, shuffle)
    if 8 * len(persons) >= sum(shard_sizes):  # many (a whole stream): a gather, faster than a search a person
        return persons + np.repeat(offsets, shard_sizes)[persons]
    # few (a worker's slot): a search of the shards, not an array of the split's size (27 M persons: 216 MB)
    first = np.cumsum(shard_sizes) - np.asarray(shard_sizes)
    return persons + offsets[np.searchsorted(first, persons, side="right") - 1]  # the last shard starting there


def stream_persons(shard_sizes: Sequence[int], seed: int, epoch: int, lo: int, hi: int,
                   shuffle: bool = True) -> np.ndarray:
    """The persons (split numbering) at places [lo, hi) of the epoch's unshuffled stream; without ``shuffle`` the
    shards stay in the split's order (int32 below 2^31 persons: every worker holds these)."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    order = epoch_shard_order(len(sizes), seed, epoch) if shuffle else np.arange(len(sizes))
    end = np.cumsum(sizes[order])
    inside = np.clip(end, lo, hi) - np.clip(end - sizes[order], lo, hi)  # each shard's places in [lo, hi)
    place = np.arange(lo, hi, dtype=np.int64)
    place -= np.repeat(stream_offsets(sizes, seed, epoch, shuffle)[order], inside)
    return place.astype(np.int32 if sizes.sum() < 1 << 31 else np.int64)


def shuffle_windows(stream: np.ndarray, first: int, window: int, seed: int, epoch: int) -> None:
    """Shuffle in place each window of ``stream``, which holds whole windows of ``window`` places (the last may be the
    stream's shorter last one) from window ``first`` on: each by its own RNG of (seed, epoch, its index)."""
    for i, lo in enumerate(range(0, len(stream), window)):
        part = stream[lo : lo + window]
        part[:] = part[np.random.default_rng([seed, epoch, first + i, _TOKENS_TAG]).permutation(len(part))]


def epoch_stream(shard_sizes: Sequence[int], seed: int, epoch: int, window: int,
                 shuffle: bool = True) -> np.ndarray:
    """The persons (split numbering) in the epoch's reading order: shards by epoch_shard_order, each window of
    ``window`` stream places shuffled on its own; without ``shuffle``, the split's order."""
    stream = stream_persons(shard_sizes, seed, epoch, 0, int(sum(shard_sizes)), shuffle)
    if shuffle:
        shuffle_windows(stream, 0, window, seed, epoch)
    return stream


def window_tokens(lengths: np.ndarray, shard_sizes: Sequence[int], seed: int, epoch: int, window: int,
                  shuffle: bool = True, chunk: int = _CHUNK) -> np.ndarray:
    """The tokens of the epoch's stream before each of its windows, then all of them (int64, windows + 1 values): one
    pass over ``lengths`` in the split's order, ``chunk`` persons at a time, summed in pieces that lie in one shard and
    one window (a window's shuffle does not change its tokens)."""
    sizes, lengths = np.asarray(shard_sizes, dtype=np.int64), np.asarray(lengths)
    n = int(sizes.sum())
    offsets = stream_offsets(sizes, seed, epoch, shuffle)
    split_first = np.cumsum(sizes) - sizes
    full = sizes > 0
    starts = (split_first + offsets)[full]  # each non-empty shard's first place
    cuts = np.unique(np.concatenate([np.arange(0, n, window), starts]))  # the places that start a piece
    # the shard of each cut: the last non-empty shard starting at or before it, in stream order
    by_place = np.argsort(starts)
    shard = np.flatnonzero(full)[by_place][np.searchsorted(starts[by_place], cuts, side="right") - 1]
    at = cuts - offsets[shard]  # each piece's first person: pieces are runs of the split's order too
    pieces = np.argsort(at)
    at, win = at[pieces], cuts[pieces] // window
    # summed a chunk of the lengths at a time: a reduceat into int64 casts all it is given (27 M persons: 206 MiB)
    heads = np.unique(np.concatenate([at, np.arange(0, n, chunk)]))  # pieces, also cut at the chunks' edges
    sums = np.empty(len(heads), dtype=np.int64)
    bounds = np.searchsorted(heads, np.arange(0, n + chunk, chunk)).tolist()
    for lo, (a, b) in zip(range(0, n, chunk), itertools.pairwise(bounds), strict=True):
        sums[a:b] = np.add.reduceat(lengths[lo : lo + chunk], heads[a:b] - lo, dtype=np.int64)
    tokens = np.zeros(-(-n // window) + 1, dtype=np.int64)
    np.add.at(tokens, win[np.searchsorted(at, heads, side="right") - 1] + 1, sums)
    return np.cumsum(tokens)


def slot_shares(total: int, slots: int) -> np.ndarray:
    """The token places of the slot edges of a stream of ``total`` tokens cut into ``slots`` slots of equal
    tokens: slot q holds the persons whose last token ends past share q and by share q + 1 (share 0 = 0, share
    ``slots`` = ``total``)."""
    return -(-np.arange(slots + 1, dtype=np.int64) * total // slots)


def split_edges(order: np.ndarray, places: np.ndarray, lengths: np.ndarray, window: int,
                slots: int) -> np.ndarray:
    """``order`` (a stream, or the rest of one, ``places`` its persons' places in the epoch's unshuffled stream)
    with the persons of each window that an edge between its ``slots`` slots (:func:`slot_shares`) cuts rearranged
    so that the edge falls between two runs of the window's places (:func:`split_at`). Each slot then reads only its
    own part of the window, where the shuffled window would have each of the two slots decode all of it."""
    if slots == 1 or not len(order):
        return order
    lens = lengths[order].astype(np.int64)
    return split_at(order, places, lens, window, slot_shares(int(lens.sum()), slots)[1:-1])


def split_at(order: np.ndarray, places: np.ndarray, lens: np.ndarray, window: int,
             shares: np.ndarray) -> np.ndarray:
    """``order`` (whole windows of a stream, ``places`` their persons' places, ``lens`` their lengths) with the
    persons of each window that a token position of ``shares`` (counted from the order's start) cuts rearranged:
    the persons before the cut are the window's first by place, and each part keeps its shuffled order. The tokens
    before every person outside such a window, hence the cuts' persons, are unchanged."""
    end = np.cumsum(lens)
    win = places // window  # non-decreasing: a stream's windows are runs of it
    after = np.searchsorted(end, shares, side="right")  # each cut's first person of the later slot
    first = np.searchsorted(win, win[np.minimum(after, len(order) - 1)])  # its window's first person
    cut = after < len(order)
    inside = cut & (after > first)  # a cut at a window's first person needs nothing ...
    # ... unless another cut rearranges its window: the window's first person may then change, so it is cut by place
    # too (else a shorter new first person ends by the share, and both slots read the window's places around it)
    inside |= cut & np.isin(first, first[inside])
    shares, after, first = shares[inside], after[inside], first[inside]
    if not len(shares):
        return order
    # the windows cut, their persons by place (each window's run at once: the windows' places are disjoint)
    lo, edge_run = np.unique(first, return_inverse=True)
    hi = np.searchsorted(win, win[lo], side="right")
    idx = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)])
    by_place = np.argsort(places[idx])  # places are distinct: any sort
    cum = np.cumsum(lens[idx][by_place])
    run_at = np.cumsum(hi - lo) - (hi - lo)  # each window's first in idx
    # a cut as a count of persons by place: those whose tokens end by the share go before it
    done = cum[run_at - 1] * (run_at > 0)  # tokens of the earlier windows of idx
    edges = np.searchsorted(cum, done[edge_run] + shares - (end[lo] - lens[lo])[edge_run], side="right")
    rank = np.empty(len(idx), dtype=np.int64)
    rank[by_place] = np.arange(len(idx))
    # each part by place keeps its shuffled order; the person right after a cut leads its part, so it ends past
    # the share (every part stays in its window's run: the parts' keys grow with the places)
    small = np.int16 if len(edges) < 1 << 14 else np.int64  # int16 keys sort by radix
    leads = np.ones(len(idx) + 1, dtype=small)
    leads[edges] = 0
    key = 2 * np.searchsorted(edges, rank, side="right").astype(small) + leads[rank]
    order = order.copy()
    order[idx] = order[idx][np.argsort(key, kind="stable")]
    return order


def slot_stream(lengths: np.ndarray, shard_sizes: Sequence[int], slot: int, slots: int, seed: int, epoch: int,
                window: int, shuffle: bool = True) -> np.ndarray:
    """The persons of slot ``slot`` of ``slots`` of the epoch's stream, in its order: ``split_edges`` of the whole
    :func:`epoch_stream` cut at the slot edges, found from the windows the slot overlaps alone (module docstring).

    Args:
        lengths: real tokens of each person of the split, in its order (>= 1).
        shard_sizes: persons of each shard of the split, the remainder last.
        slot, slots: which slot (0 <= slot < slots) of how many.
        seed, epoch, window, shuffle: the stream's reshuffle, as :func:`epoch_stream` takes them.
    """
    lengths = np.asarray(lengths)
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} out of range for {slots} slots")
    before = window_tokens(lengths, shard_sizes, seed, epoch, window, shuffle)
    n = int(sum(shard_sizes))
    share = slot_shares(int(before[-1]), slots)
    # the window that holds the first person ending past each share
    win = np.minimum(np.searchsorted(before, share, side="right") - 1, len(before) - 2)
    lo_w, hi_w = int(win[slot]), int(win[slot + 1])
    lo, hi = lo_w * window, min((hi_w + 1) * window, n)
    shuffled = np.arange(hi - lo)  # the windows' places shuffled as epoch_stream shuffles their persons
    if shuffle:
        shuffle_windows(shuffled, lo_w, window, seed, epoch)
    order = stream_persons(shard_sizes, seed, epoch, lo, hi, shuffle)[shuffled]
    places = shuffled + lo
    lens = lengths[order].astype(np.int64)
    # every slot edge inside these windows, as split_edges cuts the whole stream
    inner = share[1:-1]
    inner = inner[(inner >= before[lo_w]) & (inner < before[hi_w + 1])] - before[lo_w]
    order = split_at(order, places, lens, window, inner)
    end = np.cumsum(lengths[order], dtype=np.int64)
    first, last = np.searchsorted(end, share[[slot, slot + 1]] - before[lo_w], side="right")
    return order[first:last]
