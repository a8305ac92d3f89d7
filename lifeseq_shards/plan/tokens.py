"""The token-budget epoch as the reader runs it: the split's fixed inputs (:class:`TokenSchedule`), the plan of the
leg that reads now, and where its persons lie in the shards. Pure, like the rest of plan/.

Contract. An epoch read in one arrangement is :func:`~lifeseq_shards.plan.balance.plan_epoch`'s plan; ``len()`` is
:meth:`TokenSchedule.steps` of the arrangement, the same every epoch. A checkpoint says how many steps of the epoch each
leg took (``Position.history``, then ``batches`` in the reading arrangement's numbering): the persons of the later
steps of each leg's plan are the *rest*, kept in the epoch's stream order, and the next leg plans them as a split of
its own (:func:`~lifeseq_shards.plan.balance.plan_persons`), in another arrangement (ranks, workers, batches per
message) or another budget alike. The rest's G steps are numbered to end where an ordinary epoch of the arrangement
ends: its first is ``base = steps - G``. So every person is trained on exactly once an epoch however often it is
resumed, every rank takes the same steps, and the next epoch is an ordinary one. A rest too small to give every rank a
person at every step is refused (ValueError naming what to change) rather than read unequally.

Where the persons lie: the epoch's stream, unshuffled, is the shards in ``epoch_shard_order``; its windows of
``window`` places are shuffled each on its own, so a person stays in its window. A worker's batches are runs of the
(rest of the) stream, but for a few persons a batch takes from the start of the next (the plan's lookahead), hence
its persons' windows only grow from batch to batch except across a window edge near a cut:
:func:`TokenSchedule.ordered_windows` yields each window once (such neighbours joined as one), with the persons of it
to yield (each batch's persons by stream place), and only the places from its first such person to its last. A
window that a slot edge cuts is split by place before planning (:func:`~lifeseq_shards.plan.stream.split_edges`,
:meth:`TokenSchedule.leg` as :func:`~lifeseq_shards.plan.balance.plan_epoch`), so each of its two slots reads
only its own places.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .balance import TOKENS, TokenPlan, plan_persons, plan_slot
from .budget import epoch_steps
from .order import Window
from .partition import epoch_shard_order
from .resume import Arrangement, Leg
from .slots import Segment, _cut
from .stream import epoch_stream, split_edges, stream_places


def stream_window(history: Sequence[Leg], arrangement: Arrangement) -> int:
    """The window of the epoch's stream: the one of the arrangement that read its start."""
    return (history[0].arrangement if history else arrangement).window


@dataclass(frozen=True, eq=False)
class TokenSchedule:
    """What every token-budget epoch of one split is planned from: each person's ``lengths`` (the split's order:
    shards in manifest order, then the remainder), ``shard_sizes`` (the same shards' persons), the ``seed``, whether
    the epochs are reshuffled (``shuffle``), and the ``cost`` the deal evens out (:data:`~.balance.TOKENS` or
    :data:`~.balance.ATTENTION`). The arrangement (ranks, workers, budget, window, batches per message) is handed to
    each query, so one schedule serves a resume in another arrangement."""

    lengths: np.ndarray
    shard_sizes: tuple[int, ...]
    seed: int = 0
    shuffle: bool = True
    cost: tuple[float, float] = TOKENS

    def __post_init__(self) -> None:
        # int32: every worker holds a copy (4 bytes a person, 108 MB at 27 M), and plan_persons works in int32
        object.__setattr__(self, "lengths", np.asarray(self.lengths, dtype=np.int32))
        sizes = np.asarray(self.shard_sizes, dtype=np.int64)
        if int(sizes.sum()) != len(self.lengths):
            raise ValueError(f"shard sizes add up to {int(sizes.sum())}, not the {len(self.lengths)} lengths")

    @functools.cached_property
    def total(self) -> int:
        return int(np.asarray(self.lengths).sum(dtype=np.int64))

    @functools.cached_property
    def longest(self) -> int:
        return int(np.asarray(self.lengths).max(initial=0))

    def steps(self, arrangement: Arrangement) -> int:
        """Steps of an ordinary epoch in ``arrangement`` (``len()``): ValueError for a budget or arrangement the plan
        refuses."""
        return epoch_steps(self.total, self.longest, arrangement.tokens_per_batch, arrangement.world_size,
        arrangement.num_workers)

    def leg(self, epoch: int, history: Sequence[Leg], arrangement: Arrangement) -> tuple[TokenPlan, int]:
        """(the plan ``arrangement`` reads of ``epoch`` after the legs of ``history``, the step it starts at in
        ``arrangement``'s numbering): the whole epoch at 0 without a history, else the rest (module docstring)."""
        window = stream_window(history, arrangement)
        order = epoch_stream(self.shard_sizes, self.seed, epoch, window, self.shuffle)
        for i, leg in enumerate(history):
            plan = self._plan(epoch, order, leg.arrangement, window)
            base = self.steps(leg.arrangement) - plan.steps if i else 0
            taken = leg.batches - base
            if not 0 <= taken <= plan.steps:
                raise ValueError(f"a leg took batch {leg.batches} of epoch {epoch}, whose steps in its arrangement "
                                 f"are {base}..{base + plan.steps}: the checkpoint is not of this dataset's plan")
            left = np.zeros(len(self.lengths), dtype=bool)
            left[plan.remaining(taken)] = True
            order = order[left[order]]
        plan = self._plan(epoch, order, arrangement, window)
        return plan, (self.steps(arrangement) - plan.steps if history else 0)

    def slot(self, epoch: int, arrangement: Arrangement, slot: int) -> list[np.ndarray]:
        """Each batch's persons of slot ``slot`` (rank r's worker w: r K + w) of an ordinary ``epoch`` in
        ``arrangement`` (no history): the leg's plan for that slot, planned from the slot's own windows
        (:func:`~lifeseq_shards.plan.balance.plan_slot`). A cost in tokens only: the deal pools the ranks' persons."""
        if self.cost[1]:
            raise ValueError("a cost with a len^2 term deals every step's persons to the ranks: plan the leg whole")
        return plan_slot(self.lengths, self.shard_sizes, arrangement, slot, seed=self.seed, epoch=epoch,
                         shuffle=self.shuffle)

    def _plan(self, epoch: int, order: np.ndarray, arrangement: Arrangement, window: int) -> TokenPlan:
        if not self.cost[1]:  # slots (not the deal): each reads only its own part of a window an edge cuts
            order = split_edges(order, self.places(epoch, order), self.lengths, window, arrangement.slots)
        if not arrangement.num_workers:  # the rank's main process reads: no messages
            arrangement = dataclasses.replace(arrangement, batches_per_message=1)
        return plan_persons(order, self.lengths, arrangement, cost=self.cost)

    def places(self, epoch: int, persons: np.ndarray) -> np.ndarray:
        """Each person's place in the epoch's unshuffled stream (the shards in ``epoch_shard_order``)."""
        return stream_places(persons, self.shard_sizes, self.seed, epoch, self.shuffle)

    def _shards(self, epoch: int) -> list[Segment[int]]:
        """The split's shards whole, in the epoch's stream order."""
        sizes = list(self.shard_sizes)
        order = epoch_shard_order(len(sizes), self.seed, epoch) if self.shuffle else np.arange(len(sizes))
        return [Segment(int(s), 0, sizes[s]) for s in order]

    def ordered_windows(self, epoch: int, window: int,
                        batches: Sequence[np.ndarray]) -> Iterator[tuple[Window, np.ndarray]]:
        """The windows holding ``batches`` (each a batch's persons, in the order they are read), each once and in
        stream order, with the indices into it of the persons it gives, in the order they are yielded: every
        batch's persons sorted by stream place, batch after batch. Where a batch took a person of a later window
        (the plan's lookahead, near a cut) before the next batch's persons of an earlier one, those windows are
        given as one: the persons yielded between two cuts here lie in windows below
        all that follow, so each window is still read once."""
        if not batches:
            return
        pos = self.places(epoch, np.concatenate(batches))
        # batch after batch, each by stream place: one sort of (batch, place) packed in an int64 (a lexsort
        # of the two was 15x slower)
        bits = int(pos.max()).bit_length()
        key = np.repeat(np.arange(len(batches), dtype=np.int64) << bits, [len(b) for b in batches])
        key |= pos
        key.sort()
        pos = key & ((1 << bits) - 1)
        win = pos // window
        # a cut before yield i + 1 where every window so far is below every window to come
        below = np.maximum.accumulate(win)[:-1] < np.minimum.accumulate(win[::-1])[::-1][1:]
        shards = self._shards(epoch)  # once, not a window at a time
        for part in np.split(np.arange(len(pos)), np.flatnonzero(below) + 1):
            # only the places from the part's first to its last: a window a slot's run shares with the next
            # slot's (at its ends) is not decoded whole by both
            lo, hi = int(pos[part].min()), int(pos[part].max()) + 1
            yield _window(shards, lo // window, lo, hi), pos[part] - lo


def _window(shards: list[Segment[int]], index: int, lo: int, hi: int) -> Window:
    """Stream places [lo, hi) of window ``index`` on (``shards``: the split's, in the epoch's stream order)."""
    return Window(index, lo, hi, tuple(_cut(shards, lo, hi)))
