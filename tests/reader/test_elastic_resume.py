"""A loader state resumed in another arrangement (workers, ranks, batch size, message size, window): the rest of its
epoch through the real reader and its DataLoader workers; another split, or a state too old to say its window, is
refused.

The truth is the shard files (``split_ids``) and what the interrupted run returned; rank 0's state serves every new
rank, as Lightning's checkpoint does.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import shardify, trained_ids

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.reader.state import state_digest

BATCH, TAKEN = 100, 3  # the old run: 2 ranks x 2 workers, batch 100, stopped after 3 batches on every rank


def make(root: Path, world: int, rank: int, workers: int, batch: int = BATCH, **kw: Any) -> ShardedLoader:
    per_message = kw.pop("batches_per_message", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-balance warning of arrangements that do not divide
        ds = ShardedDataset(root, batch_size=batch, world=World(rank, world), num_workers=workers, **kw)
    return ShardedLoader(ds, persistent_workers=False, batches_per_message=per_message)


def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for i in b["person_id"].tolist()]


def stopped(root: Path, world: int = 2, workers: int = 2, taken: int = TAKEN,
            **kw: Any) -> tuple[dict[str, Any], set[int]]:
    """Every rank of the old arrangement takes ``taken`` batches: rank 0's state (through pickle, as a checkpoint stores
    it) and the persons trained."""
    trained: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(world):
        ld = make(root, world, rank, workers, **kw)
        it = iter(ld)
        trained += ids([next(it) for _ in range(taken)])
        state = state or pickle.loads(pickle.dumps(ld.state_dict()))
        del it
    assert len(trained) == len(set(trained))
    return state, set(trained)


def old_epoch(root: Path) -> set[int]:
    """The persons of epoch 0 in the arrangement ``stopped`` reads by default (2 ranks x 2 workers): every train person,
    remainder included, but those its plan leaves out."""
    everyone, left = trained_ids(root, 2, 2, 0)
    return everyone - left


def resume(root: Path, state: dict[str, Any], world: int, workers: int, batch: int = BATCH,
           **kw: Any) -> tuple[list[list[dict[str, Any]]], list[ShardedLoader], list[str]]:
    """Every rank of the new arrangement loads ``state`` and reads the rest of its epoch: (batches per rank, loaders,
    the warnings of the loads, one per rank)."""
    loaders = [make(root, world, rank, workers, batch, **kw) for rank in range(world)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ld in loaders:
            ld.load_state_dict(state)
    said = [str(w.message) for w in caught if "another layout" in str(w.message)]
    return [list(ld) for ld in loaders], loaders, said


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "workers", "batch", "per_message"), [
    (2, 1, BATCH, None),  # 1 worker
    (1, 2, BATCH, None),  # 1 rank
    (3, 2, BATCH, None),  # 3 ranks
    (4, 0, BATCH, None),  # 4 ranks, no workers
    (2, 2, 48, 3),  # another batch size, in messages of 3
])
def test_the_rest_of_the_epoch_in_another_arrangement_reads_everyone_else_once(
        nomlm_dataset: Path, world: int, workers: int, batch: int, per_message: int | None) -> None:
    state, trained = stopped(nomlm_dataset)
    epoch = old_epoch(nomlm_dataset)
    per_rank, loaders, said = resume(nomlm_dataset, state, world, workers, batch, batches_per_message=per_message)
    rest = [i for batches in per_rank for i in ids(batches)]
    assert len(rest) == len(set(rest)), f"{len(rest) - len(set(rest))} persons read twice"
    assert not set(rest) & trained, "persons trained on before were read again"
    left = epoch - trained - set(rest)
    slots = world * max(workers, 1)
    assert len(left) < slots
    assert len(said) == world and all(f"{len(left)} persons are left out" in s for s in said), said
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1 and counts.pop() > 0, f"batches per rank {[len(b) for b in per_rank]}"
    # the epoch still ends where this arrangement's epoch ends: the rest starts at len() - its batches
    for ld, batches in zip(loaders, per_rank, strict=True):
        assert (ld.position.epoch, ld.position.batches) == (0, len(ld))
        assert sum(b["person_id"].numel() for b in batches) == len(rest) // world
    # and the next pass is epoch 1 as a loader resumed from the state saved now reads it: this arrangement's own, but
    # for the persons left out of epoch 0 (tests/plan/test_plan_resume.py)
    fresh = make(nomlm_dataset, world, 0, workers, batch, batches_per_message=per_message)
    fresh.load_state_dict(loaders[0].state_dict())
    assert fresh.position.epoch == 1 and ids(list(loaders[0])) == ids(list(fresh))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nobody_left_out_of_a_rest_is_left_out_of_the_next_epoch(ds8: Path) -> None:
    """The sample in 8 shards, 2 ranks x 2 workers stopped after 5 batches, resumed on 3 x 2 (before: remainder
    person 4, left out of the rest, was left out of epoch 1 too): every person epoch 0 left out is read in epoch
    1, whether the same loaders go on after a loop's set_epoch(1) or new loaders resume from the state saved at the
    epoch's end."""
    state, trained = stopped(ds8, taken=5)
    per_rank, loaders, _ = resume(ds8, state, 3, 2)
    everyone, _ = trained_ids(ds8, 1, 0, 0)
    left = everyone - trained - {i for batches in per_rank for i in ids(batches)}
    assert left, "the arrangements leave nobody out: nothing to check"
    saved = pickle.loads(pickle.dumps(loaders[0].state_dict()))
    assert saved["epoch"] == 1 and sorted(saved["left_out_before"]) and "history" not in saved
    for ld in loaders:
        ld.set_epoch(1)  # a loop's set_epoch at the top of the next epoch keeps whom it reads
    going_on = [ids(list(ld)) for ld in loaders]
    resumed = [make(ds8, 3, rank, 2) for rank in range(3)]
    for ld in resumed:
        ld.load_state_dict(saved)
    from_state = [ids(list(ld)) for ld in resumed]
    assert from_state == going_on
    epoch1 = {i for rank in going_on for i in rank}
    assert not left - epoch1, f"left out two epochs running: {sorted(left - epoch1)}"
    assert len(everyone - epoch1) < 6 and len(epoch1) == sum(map(len, going_on))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rest_stopped_again_resumes_exactly_in_its_arrangement_and_in_a_third(nomlm_dataset: Path) -> None:
    """2x2 -> 3 ranks x 2 workers, stopped after 4 batches of the rest: the same arrangement goes on with exactly the
    batches it had left; 1 rank x 0 workers reads everyone still untrained once."""
    state, trained = stopped(nomlm_dataset)
    full, _, _ = resume(nomlm_dataset, state, 3, 2)
    loaders = [make(nomlm_dataset, 3, rank, 2) for rank in range(3)]
    second: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank, ld in enumerate(loaders):
            ld.load_state_dict(state)
            it = iter(ld)
            got = ids([next(it) for _ in range(4)])
            assert got == ids(full[rank][:4])
            trained |= set(got)
            second = second or pickle.loads(pickle.dumps(ld.state_dict()))
            del it
    assert len(second["history"]) == 1 and second["batches"] == loaders[0].position.batches
    again, _, said = resume(nomlm_dataset, second, 3, 2)
    assert not said, "the same arrangement resumes without a word"
    assert [ids(b) for b in again] == [ids(b[4:]) for b in full]
    third, _, said = resume(nomlm_dataset, second, 1, 0)
    rest = ids(third[0])
    epoch = old_epoch(nomlm_dataset)
    assert len(rest) == len(set(rest)) and not set(rest) & trained
    assert len(epoch - trained - set(rest)) == 0 and len(said) == 1  # one rank, one reader: nobody left out


@pytest.mark.timeout(120)
def test_nothing_trained_yet_starts_the_new_arrangements_own_epoch(nomlm_dataset: Path) -> None:
    state, _ = stopped(nomlm_dataset, taken=0)
    per_rank, _, said = resume(nomlm_dataset, state, 1, 0)
    fresh = make(nomlm_dataset, 1, 0, 0)
    assert not said and ids(per_rank[0]) == ids(list(fresh))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("change", "named"), [({"seed": 1}, "seed 0 -> 1"), ({"shuffle": False}, "shuffle"),
                                               ({"split": "val"}, "split")])
def test_what_cannot_continue_exactly_is_still_refused(nomlm_dataset: Path, change: dict[str, Any],
                                                       named: str) -> None:
    state, _ = stopped(nomlm_dataset, world=1, workers=0)
    with pytest.raises(ValueError, match=f"cannot resume exactly: .*{named}"):
        make(nomlm_dataset, 2, 0, 0, **change).load_state_dict(state)


@pytest.mark.timeout(120)
def test_a_complete_pass_resumes_only_in_its_own_arrangement(nomlm_dataset: Path) -> None:
    """Inference ranks have unequal lengths: no common position to continue from in other ranks."""
    ld = make(nomlm_dataset, 1, 0, 0, mode="complete")
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    del it
    with pytest.raises(ValueError, match="complete pass .* resumes only in its own arrangement"):
        make(nomlm_dataset, 2, 0, 0, mode="complete").load_state_dict(state)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("gpus", "workers", "batch", "drop_last"), [(3, 2, BATCH, False), (5, 1, 48, True)])
def test_shardify_plan_resume_says_what_the_reader_does(nomlm_dataset: Path, tmp_path: Path, gpus: int,
                                                        workers: int, batch: int, drop_last: bool) -> None:
    """`shardify plan --resume CKPT`: the rest's batches per rank, where it starts, who is left out, against a real
    rest read by every new rank (from a file of state_dict(), from a Lightning-style checkpoint entry and from a
    plain loop's checkpoint as docs/guides/train-plain-loop.md saves it)."""
    state, trained = stopped(nomlm_dataset)
    torch.save(state, tmp_path / "loader.pt")
    torch.save({"LifeSeqDataModule": {"train": state}, "global_step": 3}, tmp_path / "lightning.ckpt")
    torch.save({"model": {"w": torch.zeros(2)}, "optimizer": {}, "data": {"train": state}}, tmp_path / "loop.ckpt")
    flags = ["--gpus", gpus, "--workers", workers, "--batch-size", batch] + (["--drop-last"] if drop_last else [])
    outs = [shardify("plan", nomlm_dataset, *flags, "--resume", tmp_path / name)
            for name in ("loader.pt", "lightning.ckpt", "loop.ckpt")]
    assert outs[0] == outs[1] == outs[2]
    code, out = outs[0]
    per_rank, first, end = map(int, re.search(r"(\d+) batches per rank \(all equal\), batches (\d+)\.\.(\d+)",
                                              out).groups())
    assert f"trained on before: {len(trained)} persons" in out
    per_rank_read, loaders, _ = resume(nomlm_dataset, state, gpus, workers, batch, drop_last=drop_last)
    assert [len(b) for b in per_rank_read] == [per_rank] * gpus
    assert [(ld.position.epoch, ld.position.batches) for ld in loaders] == [(0, end)] * gpus and first == end - per_rank
    epoch = old_epoch(nomlm_dataset)
    left = len(epoch - trained - {i for b in per_rank_read for i in ids(b)})
    said = re.search(r"NOT EXACT: (\d+) persons of the rest", out)
    dropped = re.search(r"drop_last drops (\d+) persons", out)
    assert left == (int(said.group(1)) if said else 0) + (int(dropped.group(1)) if dropped else 0)
    assert code == (1 if left else 0)
    # and counted against the split: the first arrangement's plan had left some of it out of the epoch already
    everyone, _ = trained_ids(nomlm_dataset, 2, 2, 0)
    split_left = len(everyone - trained - {i for b in per_rank_read for i in ids(b)})
    assert len(everyone - epoch) > 0 and f"left out of epoch 0: {split_left} of the split's {len(everyone)}" in out
    assert "nothing is left out" not in out


def test_shardify_plan_resume_refuses_what_cannot_continue(nomlm_dataset: Path, tmp_path: Path) -> None:
    state, _ = stopped(nomlm_dataset, world=1, workers=0)
    other = {**state, "fingerprint": "0" * 32}  # another dataset's state, as its own loader saved it (with its digest)
    torch.save({**other, "digest": state_digest(other)}, tmp_path / "other.pt")
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "weights.ckpt")
    torch.save({"a": {"train": state}, "b": {"train": state}}, tmp_path / "two.ckpt")
    for name, said in (("other.pt", "fingerprint"), ("junk.ckpt", "not a checkpoint torch can load"),
                       ("weights.ckpt", "holds no loader states"), ("two.ckpt", "holds 2 loader states")):
        code, out = shardify("plan", nomlm_dataset, "--batch-size", 64, "--resume", tmp_path / name)
        assert code == 2 and said in out and len(out.strip().splitlines()) == 1, out


# -- resume only into the same order, split and state -----------------------------------------------------------------
def started_loader(root: Path, split: str = "train", **kw: Any) -> ShardedLoader:
    ld = ShardedLoader(ShardedDataset(root, split=split, batch_size=100, world=World(0, 1), **kw))
    it = iter(ld)
    for _ in range(3):
        next(it)
    return ld


@pytest.mark.parametrize("change", [{"window": 8192}, {"window": 1000}, {"window": 40_000}])
def test_resume_in_another_window_reads_the_rest_once(nomlm_dataset: Path, change: dict[str, int]) -> None:
    """Before the window was recorded: resumed with some persons twice and as many missed. Then refused; now the
    rest of the epoch, in the window it was begun in (tests/reader/test_elastic_resume.py has the other arrangement
    changes)."""
    ld = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1)))
    it = iter(ld)
    trained = [i for _ in range(3) for i in next(it)["person_id"].tolist()]
    state = ld.state_dict()
    del it
    again = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1), **change))
    with pytest.warns(UserWarning, match=r"resumes in another layout \(window 4096 -> "):
        again.load_state_dict(state)
    rest = [i for b in again for i in b["person_id"].tolist()]
    assert len(rest + trained) == len(set(rest + trained))
    everyone, left = trained_ids(nomlm_dataset, 1, 0, 0)  # one reader: the whole split, remainder included
    assert not left and set(rest + trained) == everyone


def test_resume_refuses_another_split(nomlm_dataset: Path) -> None:
    """Before: a val loader went on with train persons from batch 3."""
    state = started_loader(nomlm_dataset).state_dict()
    said = re.escape(f"{nomlm_dataset}: cannot resume exactly: split ['train'] -> ['val']")
    with pytest.raises(ValueError, match=said + ".*checkpoint's settings, or start the epoch over: restart_epoch=True"):
        val = ShardedDataset(nomlm_dataset, split="val", batch_size=100, world=World(0, 1))
        ShardedLoader(val).load_state_dict(state)


def test_resume_refuses_a_state_that_predates_the_window(nomlm_dataset: Path) -> None:
    """An older loader state cannot say which window or split it was read with: refused, not guessed."""
    state = started_loader(nomlm_dataset).state_dict()
    for key in ("split", "window"):
        state["layout"].pop(key, None)
    ld = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1)))
    with pytest.raises(ValueError, match="does not record split, window"):
        ld.load_state_dict(state)
