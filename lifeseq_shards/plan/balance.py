"""Token-budget steps: which persons each rank trains on at each step of an epoch, so that every rank carries close to
the same work and never more than a budget of real tokens. A pure function of the persons' lengths, the arrangement, the
seed and the epoch (:func:`plan_epoch`): every rank and DataLoader worker computes the same plan, nothing is
exchanged.

Design (one epoch, R ranks, K DataLoader workers a rank, budget B real tokens a rank a step, m the longest person):

* **The stream.** Persons are numbered as the split lists them (its shards in manifest order, then the remainder
  shard). The epoch reads the shards, remainder included, in :func:`~lifeseq_shards.plan.partition.epoch_shard_order`
  (a permutation by (seed, epoch)), and shuffles each window of ``window`` consecutive stream places on its own,
  as :mod:`lifeseq_shards.plan.order` does for a slot's stream.
* **Steps.** G, the steps of an epoch, is the fewest, a multiple of K, with T + R K m <= G R (B - m) (the slots'
  margin) and T <= G (R (B - m) - m) (the deal's), T the split's tokens: a function of T, m, R, K and B alone, hence
  the same every epoch (``len()`` is exact and constant), and never more for a part of the split (the rest of an
  epoch) than for all of it. Worker w's j-th batch is yielded at the rank's step :func:`step_of` (the DataLoader's
  round robin, ``per_message`` batches a message).
* **Slots (a cost in tokens, the default).** The stream is cut at token positions into R K slots, slot r K + w
  (rank r's worker w) a contiguous run holding an equal share of the tokens: person i goes to slot
  floor((e_i - 1) R K / T), e_i the stream's tokens up to its end, so a slot holds S < T / (R K) + m tokens. Each
  slot's run is cut the same way into its n = G / K batches, batch j ending by ceil((j + 1) S / n) tokens into the
  slot; then the gap batch j - 1 leaves to that share is filled from below by up to :data:`PICKS` persons, each the
  longest that still fits the gap, among the next batch's first :data:`LOOKAHEAD` persons (never its first). The
  window is shuffled anyway, so the order within a batch is free; the ranks of a step are then within a few tokens
  of each other (docs/results/balance.md). **Budget:** batch j starts after its slot's first j S / n + 1 - m tokens
  (its first person ends past the share j S / n) and ends by ceil((j + 1) S / n) < (j + 1) S / n + 1 (picks only
  fill the gap to it), so it holds under S / n + m < T / (G R) + m K / G + m <= B tokens. **Reading:** each slot is
  one worker's run of the stream, a few consecutive windows of its shards. A window that a slot edge cuts would be
  decoded whole by both slots (its persons are shuffled across its places), so
  :func:`~lifeseq_shards.plan.stream.split_edges` first puts the window's persons of lower places before the edge
  (each part still shuffled): each slot decodes only its part. A pick takes a person at most :data:`LOOKAHEAD`
  places ahead, rarely across a window edge (the reader then joins the two windows,
  :meth:`~lifeseq_shards.plan.tokens.TokenSchedule.ordered_windows`): every block is decoded about once in all, as
  the persons plan decodes it. **Planning:** a slot's batches depend only on its own persons, and its edges only on
  the windows' token sums, so a worker plans an ordinary epoch's slot from its own windows (:func:`plan_slot`, the
  same batches as the whole plan's): a 1 / (R K) share of the work, not the whole epoch's.
* **Deal (a cost with a len^2 term, e.g. :data:`ATTENTION`).** Balancing len^2 across ranks that read distant runs
  cannot keep a token budget (a run of short persons holds many tokens for its len^2), so this cost keeps the pooled
  design: the stream is cut into G groups of equal tokens, one a step (a group holds at most T / G + m tokens), and
  a group's persons are dealt to the ranks by length, longest first, in rounds of R persons, one a rank a round: the
  round's longest to the rank of least ``cost`` so far, its next to the next least, and so on. The rounds' length
  spans add up to at most m, so the ranks' tokens stay within one longest person of each other: the busiest rank
  holds at most (T / G + m) / R + m <= B tokens. Worker w of every rank owns groups [w G / K, (w+1) G / K) and keeps
  its own persons of them: each block is decoded R times in all, the price of balancing len^2 from one pool.
* **Nobody is left out.** Batches hold as many persons as fit, so no remainder needs dropping: every person of the
  split is read exactly once each epoch. An arrangement whose steps might not give every rank a person is refused
  (ValueError, :func:`~lifeseq_shards.plan.budget.epoch_steps`, the same answer every epoch: a slot's batch share
  must hold a longest person, so that every batch keeps the first person of its run), as is a budget under
  :data:`~lifeseq_shards.plan.budget.MIN_BUDGET_PERSONS` longest persons (the margin of one longest person that
  guarantees the budget would leave too little).
* **Resume.** After ``d`` steps of an epoch (every rank the same), the persons of steps >= d remain
  (:meth:`TokenPlan.remaining`) and each worker's pass resumes in the role and batch :meth:`TokenPlan.pass_roles`
  says: an exact mid-epoch resume in the same arrangement. In another arrangement or budget the rest is planned as a
  split of its own (:mod:`lifeseq_shards.plan.tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .budget import epoch_steps
from .order import pass_roles
from .resume import Arrangement
from .stream import epoch_stream, slot_stream, split_edges, stream_places

# a batch's gap to its share is filled by up to PICKS persons among the next batch's LOOKAHEAD first: enough to
# keep the ranks of a step within ~0.5 % of each other (tests/plan/test_balance.py), few enough that a pick rarely
# crosses a window edge (32 joined every other window of 4096 with batches of ~60 persons)
LOOKAHEAD, PICKS = 16, 2
TOKENS, ATTENTION = (1.0, 0.0), (0.0, 1.0)  # cost = a * len + b * len^2
# what a reader's ``balance=`` names: the cost the deal evens out across the ranks of a step
BALANCES = {"tokens": TOKENS, "attention": ATTENTION}


@dataclass(frozen=True)
class TokenPlan:
    """One epoch's steps for ``arrangement``'s readers: batch (step s, rank r) is ``persons[bounds[s R + r] :
    bounds[s R + r + 1]]`` (person indices into the split's lengths, in stream order); steps in the order every rank
    yields them."""

    persons: np.ndarray
    bounds: np.ndarray
    arrangement: Arrangement

    @property
    def world_size(self) -> int:
        return self.arrangement.world_size

    @property
    def steps(self) -> int:
        return (len(self.bounds) - 1) // self.world_size

    def batch(self, step: int, rank: int) -> np.ndarray:
        """The persons rank ``rank`` trains on at step ``step``."""
        i = step * self.world_size + rank
        return self.persons[self.bounds[i] : self.bounds[i + 1]]

    def batch_sizes(self) -> np.ndarray:
        """Persons of each (step, rank) batch, shape (steps, ranks)."""
        return np.diff(self.bounds).reshape(self.steps, self.world_size)

    def step_costs(self, lengths: np.ndarray, cost: tuple[float, float] = TOKENS) -> np.ndarray:
        """``cost`` (a len + b len^2) of each (step, rank) batch, shape (steps, ranks)."""
        return _segment_sums(person_cost(np.asarray(lengths)[self.persons], cost), self.bounds).reshape(
            self.steps, self.world_size)

    def worker_steps(self, worker: int) -> np.ndarray:
        """The steps worker ``worker`` of each rank produces, in the order it yields them."""
        workers = self.arrangement.workers
        per = self.steps // workers
        return step_of(worker, np.arange(per), per, workers, self.arrangement.batches_per_message)

    def pass_roles(self, steps_done: int) -> list[tuple[int, int]]:
        """(role, batches of it given) of each worker of a rank's pass that resumes after ``steps_done`` steps of the
        epoch (:func:`~lifeseq_shards.plan.order.pass_roles`): worker k yields the role's batches from there on."""
        lay = self.arrangement
        return pass_roles(steps_done, lay.num_workers, [self.steps // lay.workers] * lay.workers,
                          lay.batches_per_message)

    def remaining(self, steps_done: int) -> np.ndarray:
        """The persons not trained on after ``steps_done`` steps of the epoch (sorted): those of the later steps."""
        if not 0 <= steps_done <= self.steps:
            raise ValueError(f"{steps_done} steps done of an epoch of {self.steps}")
        return np.sort(self.persons[self.bounds[steps_done * self.world_size] :])


def step_of(worker: int, j: np.ndarray | int, per_worker: int, workers: int, per_message: int = 1) -> np.ndarray:
    """The rank's step at which an in-order DataLoader returns batch ``j`` of worker ``worker`` when each of its
    ``workers`` workers gives ``per_worker`` batches, ``per_message`` a message (the last message of each shorter):
    all workers' messages before it, round by round, then its place in its message."""
    j = np.asarray(j, dtype=np.int64)
    q = j // per_message
    return workers * q * per_message + worker * np.minimum(per_message, per_worker - q * per_message) + j % per_message


def plan_epoch(lengths: np.ndarray, shard_sizes: Sequence[int], arrangement: Arrangement, *, seed: int = 0,
               epoch: int = 0, cost: tuple[float, float] = TOKENS, shuffle: bool = True) -> TokenPlan:
    """The token-budget plan of one epoch (module docstring).

    Args:
        lengths: real tokens of each person of the split, in its order (shards in manifest order, then the
            remainder), all >= 1.
        shard_sizes: persons of each of those shards, the remainder last (they add up to ``len(lengths)``).
        arrangement: the readers: R ranks (``world_size``), K DataLoader workers a rank (``num_workers``, 0: the
            rank's main process reads), B the most real tokens a rank's batch may hold (``tokens_per_batch``),
            the stream places shuffled together (``window``) and the batches a worker sends in one message
            (``batches_per_message``); its batch size and drop_last play no part
            (:meth:`~lifeseq_shards.plan.resume.Arrangement.of_budget` builds one from these alone).
        seed, epoch: the reshuffle; the plan is a function of these and the other arguments alone.
        cost: (a, b) of the cost a len + b len^2 that the deal evens out across the ranks of a step
            (:data:`TOKENS`, :data:`ATTENTION`); the budget is kept in tokens either way.
        shuffle: False reads the shards in manifest order and each window in order (no reshuffle by epoch).
    """
    lengths = np.asarray(lengths)
    _check(lengths, shard_sizes, arrangement)
    order = epoch_stream(shard_sizes, seed, epoch, arrangement.window, shuffle)
    if not cost[1]:  # slots: each reads only its own part of a window an edge cuts
        order = split_edges(order, stream_places(order, shard_sizes, seed, epoch, shuffle), lengths,
                            arrangement.window, arrangement.slots)
    return plan_persons(order, lengths, arrangement, cost=cost)


def plan_slot(lengths: np.ndarray, shard_sizes: Sequence[int], arrangement: Arrangement, slot: int, *,
              seed: int = 0, epoch: int = 0, shuffle: bool = True) -> list[np.ndarray]:
    """The batches of one slot of :func:`plan_epoch`'s plan (cost in tokens): slot r K + w is rank r's worker w, and
    its batch j is ``plan.batch(step_of(w, j, ...), r)``, the same persons in the same order, but planned from the
    slot's own windows (:func:`~lifeseq_shards.plan.stream.slot_stream`) rather than the whole epoch: a worker of
    one of many ranks plans an ordinary epoch in a fraction of the time. The arguments as :func:`plan_epoch` takes
    them; the batches per message only number the steps, so they play no part."""
    lengths = np.asarray(lengths)
    _check(lengths, shard_sizes, arrangement)
    steps = epoch_steps(int(lengths.sum(dtype=np.int64)), int(lengths.max()), arrangement.tokens_per_batch,
                        arrangement.world_size, arrangement.num_workers)
    k = arrangement.workers
    persons = slot_stream(lengths, shard_sizes, slot, arrangement.slots, seed, epoch, arrangement.window, shuffle)
    lens = lengths[persons].astype(np.int32)
    batch = _slot_batches(lens, int(lens.sum(dtype=np.int64)), 1, steps // k)
    persons, ends = persons[_stable_order(batch)], np.cumsum(np.bincount(batch, minlength=steps // k)).tolist()
    return [persons[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]  # slices: np.split is ~10x slower


def plan_persons(order: np.ndarray, lengths: np.ndarray, arrangement: Arrangement, *,
                 cost: tuple[float, float] = TOKENS) -> TokenPlan:
    """The token-budget steps of the persons ``order`` (indices into ``lengths``, in the order they are read: an
    epoch's stream, or the rest of one, :mod:`lifeseq_shards.plan.tokens`): cut into slots and batches (a cost in
    tokens) or into steps dealt to the ranks (a cost with a len^2 term), as the module docstring says; the other
    arguments as :func:`plan_epoch` takes them."""
    person_cost(lengths[:0], cost)  # a bad cost refused before any work
    world_size, num_workers = arrangement.world_size, arrangement.num_workers
    per_message = arrangement.batches_per_message
    stream = order
    if not len(stream):  # the rest of an epoch resumed after its last step
        return TokenPlan(stream, np.zeros(1, dtype=np.int64), arrangement)
    lens = lengths[stream].astype(np.int32, copy=False)  # a new array already: no second copy
    total, longest = int(lens.sum(dtype=np.int64)), int(lens.max(initial=0))
    steps = epoch_steps(total, longest, arrangement.tokens_per_batch, world_size, num_workers)
    k = arrangement.workers
    per = steps // k
    # the (step, rank) batch of rank r's worker w's batch j, at r G + w n + j (n = G / K): batch j of a worker is
    # yielded at the rank's step step_of
    step = step_of(np.arange(k)[:, None], np.arange(per), per, k, per_message).ravel()
    batch_of = (step * world_size + np.arange(world_size)[:, None]).ravel()
    if cost[1]:
        # int32: a few bytes a person fewer at 27 M persons; group g is batch g % n of worker g // n
        group = _runs(np.cumsum(lens, dtype=np.int64), total, steps).astype(np.int32)
        batch = batch_of[_deal(group, lens, np.bincount(group, minlength=steps), world_size, longest, cost) * steps
                         + group]
        del group
    else:
        batch = batch_of[_slot_batches(lens, total, world_size * k, per)]  # slot r K + w: rank r's worker w
    bounds = np.zeros(steps * world_size + 1, dtype=np.int64)
    np.cumsum(np.bincount(batch, minlength=steps * world_size), out=bounds[1:])
    return TokenPlan(stream[_stable_order(batch)], bounds, arrangement)


def _runs(end: np.ndarray, total: int, parts: int) -> np.ndarray:
    """Each person's run when a stream of ``total`` tokens is cut into ``parts`` runs of equal tokens at token
    positions, ``end`` the tokens up to each person's end: person i goes to run floor((end_i - 1) parts / total).
    A run holds every person whose last token falls in its share, so each run holds fewer than total / parts + m
    tokens and more than total / parts - m (m the longest), and is not empty when total / parts >= m (consecutive
    ends are at most m apart)."""
    run = end - 1
    run *= parts
    run //= total  # < parts, as end_i - 1 <= total - 1
    return run


def _slot_batches(lens: np.ndarray, total: int, slots: int, per: int) -> np.ndarray:
    """Each stream place's slot q and batch j of the slot, as q n + j (n = ``per``): the stream cut into
    ``slots`` runs of equal tokens, each run into n batches of equal tokens as :func:`_runs` cuts (each slot by its
    own tokens), then each batch's gap to its share filled from below by up to :data:`PICKS` persons of the next
    batch's first :data:`LOOKAHEAD` (never its first). A run's persons are those whose end e_i > the run's start
    share (e_i - 1 >= ceil(share)), so the cuts are found by a search of the ends, not computed a person at a time."""
    end = np.cumsum(lens, dtype=np.int64)
    edge = np.searchsorted(end, -(-np.arange(slots + 1) * total // slots), side="right")  # each slot's first
    before = np.append(end[edge[:-1]] - lens[edge[:-1]], total)  # the stream's tokens before each slot; then all
    size = np.diff(before)  # each slot's tokens
    # batch j of slot q starts at the first person ending past before_q + ceil(j S_q / n): its share so far
    share = -(-np.arange(per) * size[:, None] // per)
    first = np.searchsorted(end, before[:-1, None] + share, side="right").ravel()  # at q n + j
    nxt = np.append(first[1:], len(lens))  # the next batch's first person, or the stream's end
    gap = share.ravel() - (end[first] - lens[first] - np.repeat(before[:-1], per))  # batch j - 1's room to share
    cut = np.flatnonzero(share.ravel() > 0)  # batch j >= 1 of a slot: its first person ends a cut
    cand = first[cut, None] + np.arange(1, LOOKAHEAD + 1)
    cand_len = np.where(cand < nxt[cut, None], lens[np.minimum(cand, len(lens) - 1)], 0)  # in batch j's run
    gap = gap[cut]
    batch = np.repeat(np.arange(slots * per), np.diff(first, append=len(lens)))
    rows = np.arange(len(cut))
    for _ in range(PICKS):
        fill = np.where(cand_len <= gap[:, None], cand_len, 0)  # never over the share: the budget's margin
        best = fill.argmax(axis=1)
        took = fill[rows, best] > 0
        batch[cand[took, best[took]]] -= 1  # to batch j - 1 of the same slot
        gap[took] -= fill[took, best[took]]
        cand_len[took, best[took]] = 0  # picked: not again
    return batch


def _check(lengths: np.ndarray, shard_sizes: Sequence[int], arrangement: Arrangement) -> None:
    if sum(shard_sizes) != len(lengths) or any(s < 0 for s in shard_sizes):
        raise ValueError(f"shard sizes {list(shard_sizes)[:8]}... add up to {sum(shard_sizes)}, not the "
                         f"{len(lengths)} lengths")
    if not len(lengths) or lengths.min() < 1:
        raise ValueError("every person needs a length >= 1 (and the split at least one person)")
    if arrangement.window < 1 or arrangement.batches_per_message < 1:
        raise ValueError(f"window ({arrangement.window}) and batches per message "
                         f"({arrangement.batches_per_message}) must be >= 1")


def _deal(group: np.ndarray, lens: np.ndarray, counts: np.ndarray, world_size: int, longest: int,
          cost: tuple[float, float]) -> np.ndarray:
    """Each stream place's rank. A group's persons, longest first, are dealt in rounds of R, one a rank a round
    (so the ranks' tokens differ by at most one longest person, whatever the cost): the round's longest to the rank
    of least ``cost`` so far, its next to the next least, and so on. All groups at once, a round at a time."""
    r, steps = world_size, len(counts)
    by_len = _stable_order(group * np.int64(longest + 1) + (longest - lens))
    # groups are runs of the stream, so in this order place p is in group g[p] at place pos[p] of it
    # int32: a few bytes a person fewer at 27 M persons (steps and a group's persons are far below 2^31)
    g = np.repeat(np.arange(steps, dtype=np.int32), counts)
    pos = np.arange(len(g), dtype=np.int64)
    pos -= np.repeat(np.cumsum(counts) - counts, counts)
    pos = pos.astype(np.int32)
    rounds = -(-int(counts.max()) // r)
    work = np.zeros((steps, rounds * r))  # a group's persons' cost by place, 0 past its last
    work[g, pos] = person_cost(lens[by_len], cost)
    dealt = np.empty((steps, rounds * r), dtype=np.int8 if r < 128 else np.int64)
    loads = np.zeros((steps, r))
    for t in range(rounds):
        least = np.argsort(loads, axis=1, kind="stable")
        dealt[:, t * r : (t + 1) * r] = least
        np.put_along_axis(loads, least, np.take_along_axis(loads, least, axis=1) + work[:, t * r : (t + 1) * r],
                          axis=1)
    rank = np.empty(len(g), dtype=np.int64)
    rank[by_len] = dealt[g, pos]
    return rank


def _stable_order(major: np.ndarray) -> np.ndarray:
    """argsort(major, kind="stable"): by one sort of major and the place packed in an int64 when they fit (a
    plain sort is several times faster than a stable argsort)."""
    bits = max(1, int(len(major)).bit_length())
    if len(major) == 0 or int(major.max()) >= 1 << (62 - bits) or int(major.min()) < 0:
        return np.argsort(major, kind="stable")
    key = major.astype(np.int64) << bits
    key |= np.arange(len(major), dtype=np.int64)
    key.sort()
    key &= (1 << bits) - 1
    return key


def person_cost(lens: np.ndarray, cost: tuple[float, float]) -> np.ndarray:
    """``cost`` = (a, b) of each length: a len + b len^2 (float64); ValueError for a cost that does not grow with the
    length."""
    a, b = cost
    if a < 0 or b < 0 or a + b <= 0:
        raise ValueError(f"cost (a, b) of a len + b len^2 needs a, b >= 0 and not both 0, got {cost}")
    x = lens.astype(np.float64)
    if b:
        x *= b * x + a
    elif a != 1:
        x *= a
    return x


def balance_ratios(costs: np.ndarray) -> np.ndarray:
    """max / mean across the ranks (columns) of each step (row) of ``costs``: 1 when the ranks carry equal work."""
    return costs.max(axis=1) / costs.mean(axis=1)


def _segment_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Sums of values[bounds[i]:bounds[i+1]] (empty segments sum to 0)."""
    cum = np.zeros(len(values) + 1)
    np.cumsum(values, out=cum[1:])
    return cum[bounds[1:]] - cum[bounds[:-1]]


def person_rows(lengths: np.ndarray, tokens_per_batch: int) -> int:
    """The most persons any batch of at most ``tokens_per_batch`` real tokens can hold: how many of the shortest
    ``lengths`` add up to at most the budget. A function of the lengths and the budget alone, so the same every epoch,
    on every rank and after every resume: the person rows of a static batch shape (device.shape.StaticShape).

    Args:
        lengths: real tokens of each person of the split (the lengths :func:`plan_epoch` plans with), all >= 1.
        tokens_per_batch: B, the most real tokens a batch may hold (>= 1).
    """
    lengths = np.asarray(lengths)
    if tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch={tokens_per_batch} holds no token: use tokens_per_batch >= 1")
    if len(lengths) and lengths.min() < 1:
        raise ValueError(f"a person of length {int(lengths.min())}: every length must be >= 1")
    # a person longer than the budget never fits: only the others are sorted
    fits = lengths[lengths <= tokens_per_batch]
    return int(np.searchsorted(np.cumsum(np.sort(fits), dtype=np.int64), tokens_per_batch, side="right"))
