"""The epoch's plan as `shardify plan` prints it: a table of which slot reads what, a check of the plan's invariants
(:mod:`lifeseq_shards.plan.partition`) and a verdict; and the rest of an epoch resumed in another arrangement
(:mod:`lifeseq_shards.plan.resume`); and the token-budget plan beside the persons plan (:func:`describe_tokens`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .asked import Topology
from .balance import ATTENTION, TOKENS, balance_ratios, plan_epoch
from .compare import persons_left_out, persons_plan_costs
from .order import default_window
from .partition import EVEN, EXACT, assign, coverage, left_out, left_out_segments, slot_batches, sum_per_rank
from .resume import Arrangement, Leg, RestPlan
from .slots import Segment, dividing_workers, num_batches, num_slots, slot_persons

_MAX_SLOT_LINES = 16
# how the token-budget plan evens out the ranks of a step, by whether it balances len^2 (balance="attention")
BALANCED_BY = {False: "each (rank, worker) reads a run of the stream holding an equal share of its tokens",
               True: "each step's persons dealt to the ranks to even out len^2"}
_MAX_SEGMENTS_SHOWN = 6


@dataclass
class PlanReport:
    ok: bool
    text: str
    refused: bool = False  # the plan refuses what was asked (a budget), rather than finding problems in a plan

    @property
    def status(self) -> int:
        """`shardify plan`'s exit status: 0 ok, 1 problems found, 2 refused."""
        return 0 if self.ok else 2 if self.refused else 1


def _segments_text(segments: list[Segment[int]], shard_sizes: Sequence[int]) -> str:
    """'#3 #7 #9[0:40) R[2:5)': whole shards by number, partial ones with their person range, R the remainder."""
    def name(seg: Segment[int]) -> str:
        return "R" if seg.shard == len(shard_sizes) else f"#{seg.shard}"

    items = [
        name(seg) if seg.shard < len(shard_sizes) and seg.size == shard_sizes[seg.shard]
        else f"{name(seg)}[{seg.start}:{seg.stop})"
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
    topology: Topology,
    batch_size: int,
    *,
    drop_last: bool = False,
    seed: int = 0,
    split: str = "train",
    mode: str = EVEN,
) -> PlanReport:
    """The epoch-0 plan as `shardify plan` prints it, with a check of its invariants and a verdict: of training
    (``mode`` balanced) or of validation (exact).

    Balanced: ok is True only when the worker count divides the shards exactly (N | S): every slot then reads whole
    shards and an equal share of the remainder, and fewer than N persons, named, are left out (others each epoch).
    Exact: ok when every person is read once in equal batches per rank (else validation refuses the arrangement too).
    """
    nodes, gpus, workers = topology.nodes, topology.gpus, topology.workers
    world = nodes * gpus
    slots = num_slots(world, workers)
    num_shards = len(shard_sizes)
    total = sum(shard_sizes) + remainder
    lines = [
        f"{split} split: {num_shards} shards x {shard_sizes[0]} persons = {sum(shard_sizes)}; remainder shard R: "
        f"{remainder} persons ({'read by validation too' if mode == EXACT else 'shared out as the pooled shards'})",
        f"{nodes} node(s) x {gpus} GPU(s) = {world} ranks; {workers} worker(s) per rank -> {slots} slots; "
        f"batch {batch_size}{' (drop_last)' if drop_last else ''}; epoch 0, seed {seed}"
        + ("; mode exact (validation)" if mode == EXACT else ""),
    ]
    try:
        plan = (assign([*shard_sizes, remainder], world, workers, mode=EXACT, batch_size=batch_size)
                if mode == EXACT else
                assign(shard_sizes, world, workers, mode=EVEN, seed=seed, epoch=0, remainder=remainder))
        batches = slot_batches([*shard_sizes, remainder] if mode == EXACT else shard_sizes, world, workers,
                               batch_size, mode=mode, drop_last=drop_last, remainder=0 if mode == EXACT else remainder)
    except ValueError as e:  # exact mode: the arrangement validation refuses, and why
        return PlanReport(ok=False, text="\n".join([*lines, "", f"REFUSED: {e}"]))
    persons = [slot_persons(segments) for segments in plan]
    per_rank = sum_per_rank(batches, workers)
    dropped = left_out(shard_sizes, world, workers, mode, remainder)
    read, distinct = coverage(plan)

    lines += _slot_table(plan, persons, batches, shard_sizes, workers)
    equal = min(per_rank) == max(per_rank)
    lines += [
        "",
        f"batches per rank: {_span(per_rank)}" + (" (all equal)" if equal else " (UNEQUAL: the all-reduce would hang)"),
        f"coverage: {distinct} distinct (shard, person) positions read, {read} reads, "
        f"{'no overlap' if read == distinct else f'{read - distinct} OVERLAPPING'}; "
        f"{distinct} read + {dropped} left out = {distinct + dropped} of {total}",
    ]
    if dropped:
        who = _segments_text(left_out_segments(shard_sizes, world, workers, epoch=0, remainder=remainder),
                             shard_sizes)
        lines.append(f"left out of epoch 0: {dropped} persons ({total} % {slots} slots): {who}; epoch e leaves out "
                     f"the {dropped} after those of epoch e - 1 (R first, then #0, #1, ...), so none two epochs "
                     "running")
    # drop_last: each slot's last partial batch is read but never yielded (the coverage line counts it as read)
    tail = sum(p - b * batch_size for p, b in zip(persons, batches, strict=True)) if drop_last else 0
    if tail:
        lines.append(f"drop_last drops {tail} persons per epoch (each slot's last partial batch; a different few each "
                     "epoch)")
    if persons[0] == 0:
        lines.append(f"WARNING: {slots} slots for {total} persons - every slot reads nothing")
    elif max(per_rank) == 0:  # the reader yields an empty epoch on every rank: the run would train nothing
        lines.append(f"NO BATCHES: a slot has at most {max(persons)} persons, fewer than batch {batch_size} with "
                     f"drop_last, so every rank's epoch is empty; use --batch-size <= {min(persons)}, fewer "
                     "ranks/workers, or no --drop-last")
    ok = ((mode == EXACT or num_shards % slots == 0) and equal and read == distinct and distinct + dropped == total
          and max(per_rank) > 0)
    lines += _verdict(ok, mode, shard_sizes, remainder, nodes, gpus, workers, persons, per_rank, dropped, tail)
    return PlanReport(ok=ok, text="\n".join(lines))


def _slot_table(plan: Sequence[Sequence[Segment[int]]], persons: Sequence[int], batches: Sequence[int],
                shard_sizes: Sequence[int], workers: int) -> list[str]:
    """The plan's table: each slot's rank, worker, persons, batches and shards (the first few slots, then a summary
    of the others)."""
    slots, k = len(plan), max(workers, 1)
    lines = ["", f"{'rank':>5} {'worker':>6} {'slot':>5} {'persons':>8} {'batches':>8}  shards"]
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
    return lines


def _verdict(ok: bool, mode: str, shard_sizes: Sequence[int], remainder: int, nodes: int, gpus: int, workers: int,
             persons: Sequence[int], per_rank: Sequence[int], dropped: int, tail: int) -> list[str]:
    """The plan's last lines: EXACT (and what is left out), or NOT EXACT with the worker counts that divide."""
    num_shards, world = len(shard_sizes), nodes * gpus
    slots = num_slots(world, workers)
    if mode == EXACT:
        return ["", f"EXACT: every person once, {per_rank[0]} batches on every rank."] if ok else []
    if num_shards % slots:
        fits = dividing_workers(num_shards, world)
        loss = (
            f"{dropped} persons per epoch are left out (others each epoch)"
            if dropped
            else "nothing is left out, but those shards are split between slots"
        )
        return [
            "",
            f"NOT EXACT: {num_shards} shards do not divide into {slots} slots ({num_shards} % {slots} = "
            f"{num_shards % slots} shards pooled and sliced); {loss}.",
            f"worker counts in 1..16 that divide exactly for {nodes} x {gpus}: "
            + (", ".join(map(str, fits)) if fits else f"none (reshard to a multiple of {world} x workers shards)"),
        ]
    if ok:
        lost = [f"{dropped} persons are left out (named above)"] if dropped else []
        lost += [f"drop_last drops {tail} persons"] if tail else []
        share = f" and {persons[0] - num_shards // slots * shard_sizes[0]} persons of R" if remainder else ""
        return ["", f"EXACT: every slot reads {num_shards // slots} whole shard(s){share}; "
                  f"{' and '.join(lost) or 'nothing is left out'}."]
    return []


def describe_resume(rest: RestPlan, old: Leg, epoch: int, epoch_batches: int, split: str) -> PlanReport:
    """The rest of ``epoch`` in ``rest``'s arrangement after ``old`` (the arrangement a checkpoint was saved in and its
    position), as `shardify plan --resume` prints it, the persons left out counted against the split. ok: nobody of
    the first arrangement's epoch is left out of its rest."""
    new, was = rest.arrangement, old.arrangement
    persons = rest.slot_persons
    batches = num_batches(persons, new.batch_size, new.drop_last)
    per_rank = sum(rest.worker_batches)

    def readers(lay: Arrangement) -> str:
        messages = f", {lay.batches_per_message} batches per message" if lay.num_workers else ""
        return (f"{lay.world_size} ranks x {lay.num_workers} worker(s), batch {lay.batch_size}"
                f"{' (drop_last)' if lay.drop_last else ''}{messages}")

    lines = [
        f"{split} split, epoch {epoch}: saved after batch {old.batches} of {readers(was)}",
        f"resumed on {readers(new)} ({new.slots} slots)",
        "",
        f"trained on before: {rest.trained} persons; the rest: {persons * new.slots + rest.left_out} persons, "
        f"{persons} per slot in "
        f"{batches} batches, {per_rank} batches per rank (all equal), batches {rest.base}..{epoch_batches} of this "
        "layout's epoch; then this layout's own epochs",
    ]
    lost = rest.left_out + rest.dropped
    if rest.dropped:
        lines.append(f"drop_last drops {rest.dropped} persons of the rest (each slot's last partial batch)")
    # counted against the split, not the first arrangement's epoch: that epoch's plan had left some out already
    first = rest.level.zero.partition
    split_persons = sum(first.sizes) + first.remainder
    planned_out = split_persons - rest.trained - persons * new.slots - rest.left_out
    lines.append(f"left out of epoch {epoch}: {planned_out + lost} of the split's {split_persons} persons ("
                 f"{planned_out} by the first layout's plan of the epoch, {rest.left_out} of the rest"
                 + (f", {rest.dropped} by drop_last" if rest.dropped else "") + ")")
    if lost:
        lines += ["", f"NOT EXACT: {rest.left_out} persons of the rest do not divide among {new.slots} slots and are "
                      f"left out of this epoch{' (and the drop_last ones above)' if rest.dropped else ''}; nobody is "
                      "read twice."]
    else:
        out = (f"the {planned_out} the first layout's plan left out (fewer than its {first.world_size} x "
               f"{first.num_workers} readers) stay out of epoch {epoch}" if planned_out else "nothing is left out")
        lines += ["", f"EXACT: nobody trained on is read again, everyone else once; {out}."]
    return PlanReport(ok=not lost, text="\n".join(lines))


def describe_tokens(lengths: np.ndarray, shard_sizes: Sequence[int], topology: Topology, tokens_per_batch: int, *,
                    batch_size: int | None = None, attention: bool = False, seed: int = 0, split: str = "train",
                    window: int | None = None) -> PlanReport:
    """The epoch-0 token-budget plan as `shardify plan --tokens-per-batch` prints it: steps, persons a step, the
    balance across the ranks of a step (tokens and len^2), who is left out; beside the persons plan of
    ``batch_size`` persons a rank (default: as many as the budget holds on average). ok: False when refused.

    Args:
        lengths, shard_sizes: the split's lengths and shards, the remainder last (:func:`plan_epoch`'s).
        topology: the machines. tokens_per_batch: the budget a rank a step.
        attention: the deal evens out len^2 (attention's cost) across the ranks of a step rather than tokens.
        window: the shuffle window; default the reader's (:func:`~.order.default_window`), so that the numbers are
            those a reader of this arrangement gets.
    """
    nodes, gpus, workers = topology.nodes, topology.gpus, topology.workers
    world = nodes * gpus
    window = window if window is not None else default_window(shard_sizes[:-1])
    cost = ATTENTION if attention else TOKENS
    lines = [
        f"{split} split: {len(lengths)} persons in {len(shard_sizes) - 1} shards + remainder {shard_sizes[-1]}; "
        f"lengths median {int(np.median(lengths))}, p99 {int(np.quantile(lengths, 0.99))}, max {int(lengths.max())}",
        f"{nodes} node(s) x {gpus} GPU(s) = {world} ranks; {workers} worker(s) per rank; budget {tokens_per_batch} "
        f"tokens a rank a step, {BALANCED_BY[attention]}; epoch 0, seed {seed}",
    ]
    try:
        plan = plan_epoch(lengths, shard_sizes, Arrangement.of_budget(tokens_per_batch, world, workers, window=window),
                          seed=seed, epoch=0, cost=cost)
    except ValueError as e:
        return PlanReport(ok=False, text="\n".join([*lines, "", f"REFUSED: {e}"]), refused=True)
    sizes, tokens = plan.batch_sizes(), plan.step_costs(lengths)
    per_step = sizes.sum(axis=1)
    lines += ["", f"token-budget plan: {plan.steps} steps an epoch (every epoch; {plan.steps // max(1, workers)} a "
              f"worker), {per_step.min()}/{per_step.mean():.1f}/{per_step.max()} persons a step (min/mean/max), "
              f"{sizes.min()}/{sizes.mean():.1f}/{sizes.max()} a rank",
              f"  tokens a rank a step: max {int(tokens.max())} <= budget {tokens_per_batch}, mean "
              f"{tokens.mean():.0f} ({tokens.mean() / tokens_per_batch:.1%} of it)",
              "  " + _balance_line(tokens, plan.step_costs(lengths, ATTENTION)),
              "  left out: nobody (every person once an epoch)"]
    b = batch_size or max(1, round(tokens_per_batch / float(lengths.mean())))
    old = persons_plan_costs(lengths, shard_sizes, world, workers, b, seed=seed, window=window)
    lost = persons_left_out(shard_sizes, world, workers)
    over = int((old > tokens_per_batch).sum())
    lines += ["", f"persons plan (today), batch {b} persons a rank{'' if batch_size else ' (the budget on average)'}: "
              f"{len(old)} steps an epoch",
              f"  tokens a rank a step: max {int(old.max())}, mean {old.mean():.0f}; {over} of {old.size} batches over "
              "the budget",
              "  " + _balance_line(old, persons_plan_costs(lengths, shard_sizes, world, workers, b, seed=seed,
                                                           window=window, cost=ATTENTION)),
              f"  left out: {lost} persons an epoch (others each epoch)"]
    return PlanReport(ok=True, text="\n".join(lines))


def _balance_line(tokens: np.ndarray, attention: np.ndarray) -> str:
    t, a = balance_ratios(tokens), balance_ratios(attention)
    return (f"balance (max/mean across ranks of a step): tokens mean {t.mean():.4f} p99 {np.quantile(t, 0.99):.4f}; "
            f"len^2 mean {a.mean():.4f} p99 {np.quantile(a, 0.99):.4f}")
