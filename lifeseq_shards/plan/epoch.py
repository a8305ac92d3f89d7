"""One interface for every way of forming an epoch's batches (:class:`EpochPlan`), so that the reader, the loader's
resume and ``shardify plan`` ask the same questions of each and never ask which plan it is: the batches each
reader (rank x worker) yields, where a pass resumes, what is left of an epoch after a stop in another arrangement, and
the pieces a worker reads. Two plans implement it: batches of ``batch_size`` persons (:class:`PersonsPlan`, the
arithmetic of :mod:`.partition` and :mod:`.resume`) and batches of a token budget (:class:`BudgetPlan`, of
:mod:`.tokens`). Which one forms the batches asked for (:class:`Asked`) is :func:`plan_kind`'s answer, from each
class's own :meth:`EpochPlan.wanted`; the class then checks what was asked, builds the reader's plan
(:meth:`EpochPlan.reading`) and ``shardify plan``'s report (:meth:`EpochPlan.report`). A new way of forming batches
is one more class. Pure, like the rest of plan/: what a plan reads of a split (the persons' lengths) is handed to it
as a function it calls only when it needs them; a plan keeps only the last rest of an epoch it computed, so that a
pass asks for it once.
"""

from __future__ import annotations

import copy
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import order as plan_order
from . import partition as plan_partition
from . import resume as plan_resume
from .asked import Asked, Lengths, Topology
from .balance import BALANCES, TokenPlan
from .order import Window
from .partition import EVEN, Partition
from .report import PlanReport, describe, describe_resume, describe_tokens
from .resume import Arrangement, Position, RestPlan
from .slots import dividing_workers, slot_index
from .tokens import TokenSchedule, stream_window

Ordered = tuple[Window, np.ndarray]  # a window and the order its persons are yielded in (indices into it)


@dataclass(frozen=True)
class WorkerRead:
    """What one worker reads of a pass: ``windows()`` (the windows, or pieces of old ones, holding its batches'
    persons, each with the order they are yielded in; no I/O), from person ``first`` of that stream on, cut into
    batches of ``sizes`` persons in turn (the last, shorter one dropped when ``drop_last``); ``skip``: the batches
    of its role before its first (the numbering its messages are cut in)."""

    windows: Callable[[], Iterator[Ordered]]
    sizes: Iterable[int]
    drop_last: bool
    skip: int
    first: int = 0


class EpochPlan(ABC):
    """The epochs of one split as ``rank`` of the readers of ``arrangement`` reads them (``arrangement`` also records a
    leg of an epoch: the readers and the batches per message; :meth:`arranged` gives the plan in another one)."""

    def __init__(self, partition: Partition, rank: int, arrangement: Arrangement, name: str) -> None:
        self.partition, self.rank, self.arrangement = partition, rank, arrangement
        self.name = name  # what refusals name first (the dataset's path and split)
        self._kept: tuple[Any, Any] | None = None  # (key, value): the last rest of an epoch planned

    # -- the kind of plan: which batches it forms, what it refuses, how it is built and printed -------------------
    @classmethod
    @abstractmethod
    def wanted(cls, asked: Asked) -> bool:
        """Whether this plan forms the batches ``asked`` asks for (exactly one plan does: :func:`plan_kind`)."""

    @classmethod
    def refusal(cls, asked: Asked) -> str | None:
        """Why a reader cannot read ``asked`` with this plan, in its arguments' words (None: it can)."""
        return None

    @classmethod
    @abstractmethod
    def reading(cls, asked: Asked, partition: Partition, rank: int, arrangement: Arrangement, name: str,
                lengths: Lengths) -> EpochPlan:
        """The plan of a reader's epochs (``name``: the dataset's path and split, for refusals); ``lengths`` is
        called only by a plan that plans from them."""

    @classmethod
    def flag_refusal(cls, asked: Asked, split: str) -> str | None:
        """Why ``shardify plan`` refuses the flags that asked for ``asked`` on ``split``, in its flags' words: one
        that would do nothing with this plan (None: none)."""
        return None

    @classmethod
    @abstractmethod
    def report(cls, asked: Asked, topology: Topology, split: str, shards: tuple[list[int], int],
               lengths: Lengths) -> PlanReport:
        """Epoch 0 of ``split`` (``shards``: its shards' persons and the remainder shard's) on ``topology``, as
        ``shardify plan`` prints it."""

    def saved_settings(self) -> dict[str, Any]:
        """What a loader's state saves of this plan beside the partition's settings
        (``reader.state.saved_arrangement``'s keywords): nothing, unless the plan decides more of which persons a
        position holds."""
        return {}

    def arranged(self, arrangement: Arrangement) -> EpochPlan:
        """This plan read by the readers of ``arrangement``."""
        plan = copy.copy(self)
        plan.arrangement, plan._kept = arrangement, None
        return plan

    def _kept_as(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key`` (a pass asks the same rest several times)."""
        if self._kept is None or self._kept[0] != key:
            self._kept = key, make()
        return self._kept[1]

    @abstractmethod
    def worker_batches(self) -> list[int]:
        """Batches each worker of this rank yields in an ordinary epoch (``len()`` is their sum; the same every
        epoch). ValueError for an arrangement the plan refuses."""

    def __len__(self) -> int:
        return sum(self.worker_batches())

    @property
    @abstractmethod
    def batch_persons(self) -> int:
        """Persons of a typical batch."""

    def shard_warning(self) -> str | None:
        """What to say once a job when the readers do not divide the shards as converted (None: nothing)."""
        return None

    @abstractmethod
    def first_batch(self, at: Position) -> int:
        """The first batch of ``at``'s pass in this arrangement's numbering: 0, or where the rest of an epoch begun
        in other arrangements (``at.history``) starts."""

    @abstractmethod
    def next_epoch(self, at: Position) -> Position:
        """The start of the epoch after ``at``'s, read in this arrangement to its end: with the persons ``at``'s
        epoch left out that the next one owes (``Position.left_out_before``) where the plan leaves any out."""

    def owes(self, at: Position) -> bool:
        """Whether the epoch after ``at``'s may read persons an ordinary one would not (:meth:`next_epoch`)."""
        return False

    def pass_position(self, at: Position, n: int) -> Position:
        """Where the ``n``-th pass after the one starting at ``at`` starts."""
        while n and self.owes(at):
            at, n = self.next_epoch(at), n - 1
        return at if not n else Position(*plan_order.pass_start(at.epoch, at.batches, n))  # ordinary from here

    def after(self, at: Position, epoch_batches: int) -> Position:
        """Where the pass after ``at`` resumes: ``at`` itself until its epoch's ``epoch_batches`` are taken, then
        the next epoch's start (:meth:`next_epoch`)."""
        nxt = at.resumed(epoch_batches)
        if nxt.epoch == at.epoch or epoch_batches < len(self):
            return nxt
        return self.next_epoch(at)

    @abstractmethod
    def start_in(self, at: Position, then: Arrangement) -> Position:
        """``at``, the start of an epoch as ``then`` would have read it, read in this arrangement instead."""

    @abstractmethod
    def rest(self, at: Position) -> tuple[int, str]:
        """The rest of ``at``'s epoch after its history (the last leg: the saving arrangement's): the batch it
        starts at in this arrangement's numbering, and what a resume says of it."""

    @abstractmethod
    def describe_rest(self, at: Position, split: str) -> tuple[str, bool]:
        """The rest of ``at``'s epoch as ``shardify plan --resume`` prints it, and whether nobody is left out."""

    @abstractmethod
    def read(self, at: Position, worker: int) -> WorkerRead:
        """What ``worker`` of this rank reads of the pass that starts at ``at``."""


class PersonsPlan(EpochPlan):
    """Batches of ``batch_size`` persons: each reader's slots of the shards (:class:`Partition`), and after a
    resume in another arrangement the rest of the epoch (:class:`RestPlan`)."""

    @classmethod
    def wanted(cls, asked: Asked) -> bool:
        return not asked.tokens_per_batch

    @classmethod
    def reading(cls, asked: Asked, partition: Partition, rank: int, arrangement: Arrangement, name: str,
                lengths: Lengths) -> PersonsPlan:
        return cls(partition, rank, arrangement, name)

    @classmethod
    def flag_refusal(cls, asked: Asked, split: str) -> str | None:
        if asked.balance != "tokens":  # it would do nothing: batches of persons are not dealt by length
            return "--attention deals a token budget's persons to even out len^2: it needs --tokens-per-batch"
        if asked.batch_size is None:
            return "plan needs --batch-size (persons a rank a step) or --tokens-per-batch"
        return None

    @classmethod
    def report(cls, asked: Asked, topology: Topology, split: str, shards: tuple[list[int], int],
               lengths: Lengths) -> PlanReport:
        return describe(shards[0], shards[1], topology, asked.batch_size or 0, drop_last=asked.drop_last, split=split,
                        mode=asked.mode)

    def worker_batches(self) -> list[int]:
        return self.partition.worker_batches(self.rank)

    @property
    def batch_persons(self) -> int:
        return self.partition.batch_size

    def shard_warning(self) -> str | None:
        p = self.partition
        slots = self.arrangement.slots
        if p.mode != EVEN or not p.sizes or not len(p.sizes) % slots:
            return None
        lost = plan_partition.left_out(p.sizes, p.world_size, p.num_workers, p.mode, p.remainder)
        lost_text = (f"{lost} persons are left out this epoch (others each epoch, none two epochs running)"
                     if lost else "no person is left out, but some shards are split between readers")
        fits = ", ".join(map(str, dividing_workers(len(p.sizes), p.world_size))) or "none"
        return (f"{len(p.sizes)} shards do not divide {slots} readers ({p.world_size} ranks x "
                f"{max(1, p.num_workers)} workers); balancing statically from the manifest, the {p.remainder}-person "
                f"remainder shard included: {lost_text}. num_workers that divide them on {p.world_size} ranks: "
                f"{fits}; or convert with --workers as you run (docs/guides/tune-gpu.md: 2 a GPU).")

    def _rest(self, at: Position) -> RestPlan:
        return self._kept_as((at.epoch, at.history, at.left_out_before),
                             lambda: RestPlan(self.partition, at.epoch, at.history, self.arrangement,
                             at.left_out_before))

    def first_batch(self, at: Position) -> int:
        return self._rest(at).base if at.history else 0

    def owes(self, at: Position) -> bool:
        return bool(at.history or at.left_out_before) and self.partition.mode == EVEN

    def next_epoch(self, at: Position) -> Position:
        if self.partition.mode != EVEN:  # nobody is left out
            return Position(at.epoch + 1, 0)
        return plan_resume.next_epoch(self.partition, at, self.arrangement)

    def start_in(self, at: Position, then: Arrangement) -> Position:
        if then.tokens_per_batch:  # a budget's epoch leaves nobody out: nobody is owed
            return Position(at.epoch, 0)
        return plan_resume.start_in(self.partition, at, then, self.arrangement)

    def rest(self, at: Position) -> tuple[int, str]:
        rest = self._rest(at)
        dropped = f", and drop_last drops {rest.dropped}" if rest.dropped else ""
        return rest.base, (f"{rest.trained} persons trained on before, the rest once in {sum(rest.worker_batches)} "
                           f"batches per rank (batches {rest.base}..{len(self)} of this layout's epoch); "
                           f"{rest.left_out} persons are left out of this epoch (those of the rest that do not divide "
                           f"among {self.arrangement.slots} readers){dropped}")

    def describe_rest(self, at: Position, split: str) -> tuple[str, bool]:
        report = describe_resume(self._rest(at), at.history[-1], at.epoch, len(self), split)
        return report.text, report.ok

    def read(self, at: Position, worker: int) -> WorkerRead:
        p, lay = self.partition, self.arrangement
        rest = self._rest(at) if at.history else None  # the rest of an epoch begun in another arrangement
        if rest is not None:
            per_worker, skip_total = rest.worker_batches, at.batches - rest.base
        else:
            per_worker, skip_total = self.worker_batches(), at.batches
        role, skip = plan_order.pass_roles(skip_total, p.num_workers, per_worker, lay.batches_per_message)[worker]
        slot = slot_index(self.rank, role, p.num_workers)

        def windows() -> Iterator[Ordered]:
            if rest is not None:
                return rest.ordered_pieces(slot, skip)
            return p.ordered_windows(slot, at.epoch, skip, at.left_out_before)

        return WorkerRead(windows, itertools.repeat(p.batch_size), p.drop_last, skip, skip * p.batch_size)


class BudgetPlan(EpochPlan):
    """Batches of at most ``tokens_per_batch`` real tokens a rank, planned from every person's length
    (``schedule``): nobody left out, the same steps on every rank; after a resume in another arrangement or budget,
    the persons not yet trained on, planned again (:meth:`TokenSchedule.leg`)."""

    def __init__(self, partition: Partition, rank: int, arrangement: Arrangement, name: str, schedule: TokenSchedule,
                 asked: Asked) -> None:
        super().__init__(partition, rank, arrangement, name)
        self.schedule, self.asked = schedule, asked

    @classmethod
    def wanted(cls, asked: Asked) -> bool:
        return bool(asked.tokens_per_batch)

    @classmethod
    def refusal(cls, asked: Asked) -> str | None:
        if asked.mode != EVEN:
            return (f"tokens_per_batch is for training batches (mode='balanced'), not mode={asked.mode!r}: "
                    "validation and predict read batch_size persons a batch")
        if asked.drop_last:
            return ("drop_last with tokens_per_batch: a token budget's batches hold every person of the epoch, none "
                    "is dropped; leave drop_last=False")
        return None

    @classmethod
    def reading(cls, asked: Asked, partition: Partition, rank: int, arrangement: Arrangement, name: str,
                lengths: Lengths) -> BudgetPlan:
        """Planned from every person's length, read once here (in the split's order)."""
        persons, sizes = lengths()
        if asked.crop:  # a longer person costs the model only the tokens it sees
            persons = np.minimum(persons, asked.crop)
        schedule = TokenSchedule(persons, tuple(sizes), partition.seed, partition.shuffle, BALANCES[asked.balance])
        return cls(partition, rank, arrangement, name, schedule, asked)

    @classmethod
    def flag_refusal(cls, asked: Asked, split: str) -> str | None:
        if asked.mode != EVEN:  # it would do nothing: validation reads batches of persons
            return (f"--tokens-per-batch plans training's batches, and --split {split} is read as validation reads "
                    "it: in batches of persons, never by a budget; plan it with --batch-size")
        return None

    @classmethod
    def report(cls, asked: Asked, topology: Topology, split: str, shards: tuple[list[int], int],
               lengths: Lengths) -> PlanReport:
        persons, sizes = lengths()
        return describe_tokens(persons, sizes, topology, asked.tokens_per_batch or 0, batch_size=asked.batch_size,
                               attention=asked.balance == "attention", split=split)

    def saved_settings(self) -> dict[str, Any]:
        return {"tokens_per_batch": self.asked.tokens_per_batch, "balance": self.asked.balance,
                "crop": self.asked.crop}

    def worker_batches(self) -> list[int]:
        workers = self.arrangement.workers
        return [self.schedule.steps(self.arrangement) // workers] * workers

    @property
    def batch_persons(self) -> int:
        return max(1, round(self.arrangement.tokens_per_batch * len(self.schedule.lengths) / self.schedule.total))

    def _leg(self, at: Position) -> tuple[TokenPlan, int]:
        """The plan this arrangement reads of ``at``'s epoch after its history, and the batch it starts at."""
        def make() -> tuple[TokenPlan, int]:
            try:
                return self.schedule.leg(at.epoch, at.history, self.arrangement)
            except ValueError as e:
                raise ValueError(f"{self.name}: epoch {at.epoch}: {e}") from None

        return self._kept_as((at.epoch, at.history, self.arrangement), make)

    def first_batch(self, at: Position) -> int:
        return self._leg(at)[1] if at.history else 0

    def next_epoch(self, at: Position) -> Position:
        return Position(at.epoch + 1, 0)  # nobody is left out, so none is owed

    def start_in(self, at: Position, then: Arrangement) -> Position:
        return Position(at.epoch, 0)

    def rest(self, at: Position) -> tuple[int, str]:
        plan, base = self._leg(at)
        return base, (f"the {len(plan.persons)} persons it had not trained on are planned again, once each, in "
                      f"{plan.steps} steps per rank (batches {base}..{len(self)} of this layout's epoch); nobody is "
                      "left out")

    def describe_rest(self, at: Position, split: str) -> tuple[str, bool]:
        plan, base = self._leg(at)
        then, now = at.history[-1], self.arrangement
        was = then.arrangement
        return (f"{split} split, epoch {at.epoch}: saved after batch {then.batches} ({was.world_size} ranks x "
                f"{was.num_workers} worker(s), budget {was.tokens_per_batch}); resumed on "
                f"{now.world_size} ranks x {now.num_workers} worker(s), budget {now.tokens_per_batch}\ntrained on "
                f"before: {len(self.schedule.lengths) - len(plan.persons)} persons; the rest: {len(plan.persons)} "
                f"persons in {plan.steps} steps a rank (all equal), batches {base}..{len(self)} of this layout's "
                f"epoch; then this layout's own epochs\nleft out of epoch {at.epoch}: nobody"), True

    def read(self, at: Position, worker: int) -> WorkerRead:
        lay, schedule, workers = self.arrangement, self.schedule, self.partition.num_workers
        if at.history or schedule.cost[1]:  # the rest of an epoch, or the deal: planned whole
            plan, base = self._leg(at)
            role, skip = plan.pass_roles(at.batches - base)[worker]
            persons = [plan.batch(int(s), self.rank) for s in plan.worker_steps(role)[skip:]]
        else:  # an ordinary epoch in slots: only this worker's own (the same batches, a fraction of the work)
            role, skip = plan_order.pass_roles(at.batches, workers, self.worker_batches(),
                                               lay.batches_per_message)[worker]
            persons = schedule.slot(at.epoch, lay, slot_index(self.rank, role, workers))[skip:]
        window = stream_window(at.history, lay)
        return WorkerRead(lambda: schedule.ordered_windows(at.epoch, window, persons), [len(b) for b in persons],
                          False, skip)


def plan_kind(asked: Asked, among: type[EpochPlan] = EpochPlan) -> type[EpochPlan]:
    """The plan that forms the batches ``asked`` asks for: the one class derived from ``among`` that wants them, or
    a class derived from it that wants them too (a subclass refines its parent's plan for the requests it wants)."""
    kinds = [kind for kind in among.__subclasses__() if kind.wanted(asked)]
    if len(kinds) > 1 or not kinds and among is EpochPlan:  # a plan class's wanted() is wrong
        raise TypeError(f"{asked}: wanted by {[k.__name__ for k in kinds]}, not by exactly one plan")
    return plan_kind(asked, kinds[0]) if kinds else among
