"""The reader with a token budget (``tokens_per_batch``), on the converted sample, each rank a dataset of its own
as under DDP: every person of the split once an epoch, the same steps on every rank (``len()`` exact), no batch over
the budget, the ranks of a step balanced, reshuffled by (seed, epoch); and exact resume in the same layout, in
another layout and another budget, and across the switch between persons and a budget."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import shardify

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.reader.state import VERSION
from lifeseq_shards.store.remote import read_manifest

BUDGET = 8000  # about 24 of the sample's persons (mean length ~330)


def train_persons(root: Path) -> int:
    return read_manifest(root).splits["train"].persons


def make(root: Path, world: int, rank: int, workers: int, budget: int | None = BUDGET, **kw: Any) -> ShardedLoader:
    per_message = kw.pop("batches_per_message", None)
    ds = ShardedDataset(root, world=World(rank, world), num_workers=workers, tokens_per_batch=budget, **kw)
    return ShardedLoader(ds, persistent_workers=False, batches_per_message=per_message)


def ids(batch: Any) -> list[int]:
    return batch["person_id"].tolist()


def epoch(root: Path, world: int, workers: int, e: int = 0, **kw: Any) -> tuple[list[list[list[int]]], np.ndarray]:
    """Every rank's batches of epoch ``e`` (person ids) and their real tokens, shape (ranks, steps)."""
    persons, tokens = [], []
    for rank in range(world):
        ld = make(root, world, rank, workers, **kw)
        ld.set_epoch(e)
        batches = list(ld)
        assert len(batches) == len(ld)  # len() is exact
        persons.append([ids(b) for b in batches])
        tokens.append([int(b["lengths"].sum()) for b in batches])
    return persons, np.array(tokens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "workers", "per_message"), [(1, 0, None), (2, 0, None), (2, 2, None),
                                                              (3, 1, None), (2, 2, 3)])
def test_every_person_once_an_epoch_equal_steps_balanced(nomlm_dataset: Path, world: int, workers: int,
                                                         per_message: int | None) -> None:
    persons, tokens = epoch(nomlm_dataset, world, workers, batches_per_message=per_message)
    everyone = [p for rank in persons for b in rank for p in b]
    assert len(everyone) == len(set(everyone)) == train_persons(nomlm_dataset)  # nobody left out, nobody twice
    assert tokens.max() <= BUDGET
    ratio = tokens.max(axis=0) / tokens.mean(axis=0)  # max / mean across the ranks of each step
    assert ratio.mean() <= 1.01 and np.quantile(ratio, 0.99) <= 1.02, ratio


@pytest.mark.timeout(300)
def test_epochs_reshuffle_and_repeat(nomlm_dataset: Path) -> None:
    first, _ = epoch(nomlm_dataset, 2, 0, 0)
    again, _ = epoch(nomlm_dataset, 2, 0, 0)
    second, _ = epoch(nomlm_dataset, 2, 0, 1)
    assert first == again and first != second
    assert len(first[0]) == len(second[0])  # the same steps every epoch
    reseeded, _ = epoch(nomlm_dataset, 2, 0, 0, seed=1)
    assert reseeded != first


@pytest.mark.timeout(300)
def test_attention_balance_evens_out_len_squared(nomlm_dataset: Path) -> None:
    def len2_ratio(balance: str) -> float:
        costs = []
        for rank in range(4):
            ld = make(nomlm_dataset, 4, rank, 0, balance=balance)
            costs.append([float((b["lengths"].double() ** 2).sum()) for b in ld])
        c = np.array(costs)
        return float((c.max(axis=0) / c.mean(axis=0)).mean())

    assert len2_ratio("attention") < len2_ratio("tokens")


def stop(root: Path, world: int, workers: int, taken: int, **kw: Any) -> tuple[dict[str, Any], list[int]]:
    """Every rank takes ``taken`` batches: rank 0's state (through pickle, as a checkpoint stores it) and the
    persons trained."""
    trained: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(world):
        ld = make(root, world, rank, workers, **kw)
        it = iter(ld)
        trained += [p for _ in range(taken) for p in ids(next(it))]
        state = state or pickle.loads(pickle.dumps(ld.state_dict()))
        del it
    return state, trained


def resume(root: Path, state: dict[str, Any], world: int, workers: int,
           **kw: Any) -> tuple[list[list[list[int]]], list[ShardedLoader], list[str]]:
    loaders = [make(root, world, rank, workers, **kw) for rank in range(world)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ld in loaders:
            ld.load_state_dict(state)
    said = [str(w.message) for w in caught if "another layout" in str(w.message)]
    return [[ids(b) for b in ld] for ld in loaders], loaders, said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_in_the_same_layout_gives_the_batches_not_yet_given(nomlm_dataset: Path) -> None:
    whole, _ = epoch(nomlm_dataset, 2, 2, batches_per_message=2)
    for taken in (1, 3, 4):
        state, _ = stop(nomlm_dataset, 2, 2, taken, batches_per_message=2)
        assert state["version"] == VERSION and state["layout"]["tokens_per_batch"] == BUDGET
        rest, loaders, said = resume(nomlm_dataset, state, 2, 2, batches_per_message=2)
        assert not said
        assert rest == [rank[taken:] for rank in whole]
        assert all(ld.position.batches == len(ld) for ld in loaders)


@pytest.mark.timeout(300)
def test_a_version_3_state_is_refused_inside_an_epoch_and_read_at_its_start(nomlm_dataset: Path) -> None:
    """Version 3 states were planned before a cut at a window's first person was also cut by place: inside an
    epoch that plan may differ from this one, so resuming there is refused in one line; at an epoch's start the
    epoch is planned anew, as ever."""
    state, _ = stop(nomlm_dataset, 2, 2, 3)
    state = {k: v for k, v in state.items() if k != "digest"}  # as version 3 wrote it: no digest
    with pytest.raises(ValueError, match="has version 3: a token budget's position inside epoch 0") as e:
        make(nomlm_dataset, 2, 0, 2).load_state_dict({**state, "version": 3})
    assert "\n" not in str(e.value)
    ld = make(nomlm_dataset, 2, 0, 2)
    ld.load_state_dict({**state, "version": 3, "epoch": 1, "batches": 0})
    assert ld.position.epoch == 1 and ld.position.batches == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "workers", "budget"), [(3, 1, BUDGET), (1, 2, BUDGET), (2, 2, 12000),
                                                          (4, 0, 5000)])
def test_resume_in_another_layout_or_budget_trains_everyone_else_once(nomlm_dataset: Path, world: int,
                                                                      workers: int, budget: int) -> None:
    state, trained = stop(nomlm_dataset, 2, 2, 5)
    rest, loaders, said = resume(nomlm_dataset, state, world, workers, budget=budget)
    assert len(said) == world and "nobody is left out" in said[0]
    after = [p for rank in rest for b in rank for p in b]
    assert sorted(trained + after) == sorted(set(trained + after))  # nobody twice
    assert len(trained) + len(after) == train_persons(nomlm_dataset)  # nobody left out
    steps = {len(r) for r in rest}
    assert len(steps) == 1  # the same steps on every rank
    # the rest ends where this layout's ordinary epoch ends, and the next epoch is that ordinary epoch
    assert all(ld.position.batches == len(ld) for ld in loaders)
    assert loaders[0].state_dict()["epoch"] == 1 and loaders[0].state_dict()["batches"] == 0
    nxt = loaders[0]
    nxt.set_epoch(1)
    fresh = make(nomlm_dataset, world, 0, workers, budget=budget)
    fresh.set_epoch(1)
    assert [ids(b) for b in nxt] == [ids(b) for b in fresh]


@pytest.mark.timeout(300)
def test_a_rest_stopped_again_resumes_in_a_third_layout(nomlm_dataset: Path) -> None:
    state, trained = stop(nomlm_dataset, 2, 2, 4)
    middle = [make(nomlm_dataset, 3, rank, 1, budget=10000) for rank in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ld in middle:
            ld.load_state_dict(state)
    for ld in middle:
        it = iter(ld)
        trained += [p for _ in range(3) for p in ids(next(it))]
        del it
    again = pickle.loads(pickle.dumps(middle[0].state_dict()))
    assert len(again["history"]) == 1 and again["history"][0]["tokens_per_batch"] == BUDGET
    rest, _, _ = resume(nomlm_dataset, again, 2, 0, budget=6000)
    after = [p for rank in rest for b in rank for p in b]
    assert sorted(trained + after) == list(sorted(set(trained + after)))
    assert len(trained) + len(after) == train_persons(nomlm_dataset)


@pytest.mark.timeout(300)
def test_switching_between_persons_and_a_budget(nomlm_dataset: Path) -> None:
    # inside an epoch: refused, saying what to do
    state, _ = stop(nomlm_dataset, 2, 0, 2, budget=None, batch_size=50)
    with pytest.raises(ValueError, match="cannot resume exactly inside epoch 0: .*tokens_per_batch 0 -> 8000"):
        make(nomlm_dataset, 2, 0, 0).load_state_dict(state)
    state, _ = stop(nomlm_dataset, 2, 0, 2)
    with pytest.raises(ValueError, match="cannot resume exactly inside epoch 0: tokens_per_batch 8000 -> 0"):
        make(nomlm_dataset, 2, 0, 0, budget=None).load_state_dict(state)
    with pytest.raises(ValueError, match="balance 'tokens' -> 'attention'"):
        make(nomlm_dataset, 2, 0, 0, balance="attention").load_state_dict(state)
    # at an epoch's end: the next epoch in the new mode, whole
    ld = make(nomlm_dataset, 2, 0, 0, budget=None, batch_size=50)
    list(ld)
    ended = ld.state_dict()
    assert ended["version"] == 2 and "tokens_per_batch" not in ended["layout"]  # batches of persons: as before
    budget = make(nomlm_dataset, 2, 0, 0)
    budget.load_state_dict(ended)
    assert budget.position.epoch == 1 and budget.position.batches == 0
    assert len(list(budget)) == len(budget)


def test_a_budget_is_checked_up_front(nomlm_dataset: Path) -> None:
    with pytest.raises(ValueError, match="tokens_per_batch=100 is under 4 x the longest person"):
        make(nomlm_dataset, 2, 0, 0, budget=100)
    with pytest.raises(ValueError, match="tokens_per_batch is for training batches"):
        ShardedDataset(nomlm_dataset, split="val", mode="exact", tokens_per_batch=BUDGET)
    with pytest.raises(ValueError, match="drop_last with tokens_per_batch"):
        make(nomlm_dataset, 1, 0, 0, drop_last=True)
    with pytest.raises(ValueError, match="balance must be one of 'tokens', 'attention'"):
        make(nomlm_dataset, 1, 0, 0, balance="len2")
    with pytest.raises(ValueError, match="tokens_per_batch must be an integer >= 1"):
        make(nomlm_dataset, 1, 0, 0, budget=0)


@pytest.mark.timeout(300)
def test_packed_batches_hold_the_same_persons(nomlm_dataset: Path) -> None:
    padded, tokens = epoch(nomlm_dataset, 2, 1)
    ld = make(nomlm_dataset, 2, 0, 1, packed=True)
    from lifeseq_shards.device.build import padded_fields

    packed = [padded_fields(b) for b in ld]
    assert [b["person_id"].tolist() for b in packed] == padded[0]
    assert [int(b["lengths"].sum()) for b in packed] == tokens[0].tolist()


@pytest.mark.timeout(300)
def test_shardify_plan_resume_says_what_the_reader_does(nomlm_dataset: Path, tmp_path: Path) -> None:
    state, trained = stop(nomlm_dataset, 2, 2, 5)
    torch.save(state, tmp_path / "state.ckpt")
    code, out = shardify("plan", nomlm_dataset, "--gpus", 3, "--workers", 1, "--tokens-per-batch", 10000,
                         "--resume", tmp_path / "state.ckpt")
    assert code == 0, out
    rest, loaders, _ = resume(nomlm_dataset, state, 3, 1, budget=10000)
    after = sum(len(b) for rank in rest for b in rank)
    assert f"trained on before: {len(trained)} persons; the rest: {after} persons in {len(rest[0])} steps" in out
    assert f"batches {len(loaders[0]) - len(rest[0])}..{len(loaders[0])} of this layout's epoch" in out
    assert "left out of epoch 0: nobody" in out
    # a budget's checkpoint planned as batches of persons: refused as the loader refuses it, in one line, in the
    # CLI's words
    code, out = shardify("plan", nomlm_dataset, "--gpus", 3, "--batch-size", 50, "--resume", tmp_path / "state.ckpt")
    read = "with --tokens-per-batch 8000 (without --attention)"
    assert code == 2 and out.strip().splitlines() == [
        f"error: {tmp_path / 'state.ckpt'}: epoch 0 was read {read} up to the checkpoint, and so is the "
        f"rest of it: plan it {read}, or without --resume for the next epoch"], out


@pytest.mark.timeout(300)
def test_shardify_plan_resume_names_only_the_flags_given(nomlm_dataset: Path, tmp_path: Path) -> None:
    """A checkpoint of batches of 50 persons planned with --tokens-per-batch and no --batch-size: the refusal names
    the flag given and the checkpoint's reading, in flags; not --batch-size's default nor the loader's message size
    (before: 'batch_size 50 -> 256; batches_per_message 81 -> 20; tokens_per_batch 0 -> 10000')."""
    state, _ = stop(nomlm_dataset, 2, 2, 5, budget=None, batch_size=50)
    torch.save(state, tmp_path / "state.ckpt")
    code, out = shardify("plan", nomlm_dataset, "--gpus", 3, "--workers", 1, "--tokens-per-batch", 10000,
                         "--resume", tmp_path / "state.ckpt")
    read = "with --batch-size 50 (without --tokens-per-batch)"
    assert code == 2 and out.strip().splitlines() == [
        f"error: {tmp_path / 'state.ckpt'}: epoch 0 was read {read} up to the checkpoint, and so is the "
        f"rest of it: plan it {read}, or without --resume for the next epoch"], out
    # what it says to do works: the rest of the epoch in batches of 50 on this layout
    code, out = shardify("plan", nomlm_dataset, "--gpus", 3, "--workers", 1, "--batch-size", 50,
                         "--resume", tmp_path / "state.ckpt")
    assert code in (0, 1) and not out.startswith("error"), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_shardify_plan_prints_the_numbers_the_ranks_get(nomlm_dataset: Path, workers: int) -> None:
    """`shardify plan --tokens-per-batch`'s persons a rank a step (min/mean/max) and most tokens a rank a step are
    those of the ranks' epoch 0 (before: the plan shuffled in windows of 16,384 persons, the reader in its own
    default, and printed a plan no rank read)."""
    code, out = shardify("plan", nomlm_dataset, "--gpus", 2, "--workers", workers, "--tokens-per-batch", BUDGET)
    assert code == 0, out
    persons, tokens = epoch(nomlm_dataset, 2, workers)
    per_rank = np.array([[len(b) for b in rank] for rank in persons])
    said = re.search(r"(\d+)/([\d.]+)/(\d+) a rank\n  tokens a rank a step: max (\d+) <= budget", out)
    assert said is not None, out
    assert (int(said[1]), said[2], int(said[3])) == (per_rank.min(), f"{per_rank.mean():.1f}", per_rank.max()), out
    assert int(said[4]) == tokens.max(), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crop_counts_only_the_tokens_the_model_sees(nomlm_dataset: Path) -> None:
    """The device crops each person to 128 tokens: a budget of 600 (under 4 x the longest stored person) plans
    batches of at most 600 cropped tokens, everyone once; the crop is part of the saved budget."""
    persons, seen = [], []
    for rank in range(2):
        ld = make(nomlm_dataset, 2, rank, 0, budget=600, crop=128, packed=True)
        from lifeseq_shards.device.build import padded_fields

        for b in ld:
            fields = padded_fields(b)
            persons += fields["person_id"].tolist()
            seen.append(int(fields["lengths"].clamp(max=128).sum()))
    assert max(seen) <= 600 and len(persons) == len(set(persons)) == train_persons(nomlm_dataset)
    state, _ = stop(nomlm_dataset, 2, 0, 2, budget=600, crop=128)
    assert state["layout"]["crop"] == 128
    with pytest.raises(ValueError, match="crop 128 -> 120"):
        make(nomlm_dataset, 2, 0, 0, budget=600, crop=120).load_state_dict(state)
