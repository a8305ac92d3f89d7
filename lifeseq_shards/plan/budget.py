"""Which token budgets a split and an arrangement accept: the steps of every epoch of the token-budget plan
(:func:`epoch_steps`, the design of :mod:`lifeseq_shards.plan.balance`), the refusal of a budget that cannot keep
its margin or give every rank a person at every step, and the smallest budget that is accepted
(:func:`smallest_budget`), which each refusal names."""

from __future__ import annotations

from .slots import num_slots

# the budget must hold 4 longest persons: one a rank is the margin that keeps the budget, and R (B - m) - m then
# leaves steps of >= (R + 1) m tokens, enough to give every rank a person (epoch_steps)
MIN_BUDGET_PERSONS = 4


def epoch_steps(total_tokens: int, longest: int, tokens_per_batch: int, world_size: int, num_workers: int) -> int:
    """Steps of every epoch: the fewest, a multiple of the K workers a rank, that keep both plans under the budget
    (:mod:`lifeseq_shards.plan.balance`'s docstring): T + R K m <= G R (B - m) for the slots and
    T <= G (R (B - m) - m) for the deal. ValueError for a budget under :data:`MIN_BUDGET_PERSONS` longest persons,
    or too few tokens to give every rank a person at every step, whatever the epoch's order: T >= R m (G + K) for the
    slots (a batch's share of its slot then holds a longest person), T >= G (R + 1) m for the deal (refused up front,
    not in some later epoch). Either refusal names the smallest budget that is accepted (:func:`smallest_budget`),
    or says that none is."""
    if tokens_per_batch < MIN_BUDGET_PERSONS * longest:
        raise ValueError(f"tokens_per_batch={tokens_per_batch} is under {MIN_BUDGET_PERSONS} x the longest person "
                         f"({longest} tokens): the plan keeps one longest person a rank as its margin; "
                         + _budget_advice(total_tokens, longest, world_size, num_workers))
    steps, need = _steps_and_need(total_tokens, longest, tokens_per_batch, world_size, num_workers)
    if total_tokens < need:
        k = num_slots(world_size, num_workers) // world_size
        raise ValueError(f"the split's {total_tokens} tokens in {steps} steps ({k} a worker; the longest person "
                         f"{longest} tokens) are too few to give each of {world_size} ranks a person at every step "
                         f"(that needs {need}): " + _budget_advice(total_tokens, longest, world_size, num_workers))
    return steps


def _steps_and_need(total_tokens: int, longest: int, tokens_per_batch: int, world_size: int,
                    num_workers: int) -> tuple[int, int]:
    """:func:`epoch_steps`'s steps for a budget of at least MIN_BUDGET_PERSONS longest persons, and the tokens the
    split needs for them."""
    r, k = world_size, num_slots(world_size, num_workers) // world_size
    room = tokens_per_batch - longest
    fewest = max(-(-total_tokens // (r * room - longest)), -(-(total_tokens + r * k * longest) // (r * room)))
    steps = -(-fewest // k) * k
    return steps, max(r * longest * (steps + k), steps * (r + 1) * longest)


def smallest_budget(total_tokens: int, longest: int, world_size: int, num_workers: int) -> int | None:
    """The smallest ``tokens_per_batch`` that :func:`epoch_steps` accepts for this split and arrangement, None if none
    is. A larger budget never needs more steps, and fewer steps never need more tokens, so the budgets accepted are
    all those from one on: a binary search from MIN_BUDGET_PERSONS longest persons up to a budget that takes the
    whole split in one step a worker."""
    def accepted(budget: int) -> bool:
        return total_tokens >= _steps_and_need(total_tokens, longest, budget, world_size, num_workers)[1]

    lo = MIN_BUDGET_PERSONS * longest
    hi = total_tokens + (num_slots(world_size, num_workers) + MIN_BUDGET_PERSONS) * longest  # one step a worker
    if not accepted(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if accepted(mid) else (mid + 1, hi)
    return lo


def _budget_advice(total_tokens: int, longest: int, world_size: int, num_workers: int) -> str:
    """What a refused budget can change to: the smallest budget accepted, else the arrangement or the split."""
    fit = smallest_budget(total_tokens, longest, world_size, num_workers)
    if fit is not None:
        return f"use tokens_per_batch >= {fit}"
    if num_slots(world_size, num_workers) > 1:
        return "no budget gives each rank a person at every step: use fewer ranks or workers, or a larger split"
    return "no budget gives a person at every step of so small a split: use batch_size (batches of persons)"
