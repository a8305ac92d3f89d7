"""The loader's checkpoint state (lifeseq_shards.reader.state): a state is found inside a whole checkpoint, and a
state that is not one is refused in one line that says it is the checkpoint's and names the key or value."""

from __future__ import annotations

import copy
import itertools
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import shardify

from lifeseq_shards.plan.resume import Position
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World


def loader(root: Path, world: int = 1, rank: int = 0, batch_size: int = 100) -> ShardedLoader:
    return ShardedLoader(ShardedDataset(root, batch_size=batch_size, world=World(rank, world)))


@pytest.fixture(scope="module")
def state(nomlm_dataset: Path) -> dict[str, Any]:
    """A state 2 batches into epoch 0 of rank 0 of 1."""
    ld = loader(nomlm_dataset)
    batches = iter(ld)
    list(itertools.islice(batches, 2))
    saved = ld.state_dict()
    del batches
    return saved


def test_a_new_state_says_its_version(state: dict[str, Any]) -> None:
    assert state["version"] == 2 and state["epoch"] == 0 and state["batches"] == 2


@pytest.mark.parametrize("wrap", [
    lambda s: {"epoch": 0, "global_step": 2, "LifeSeqDataModule": {"train": s}, "state_dict": {"w": torch.zeros(2)},
               "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": {"ready": 2}}}}},
    lambda s: {"model": {"w": torch.zeros(2)}, "optimizer": {}, "data": {"train": s}},
    lambda s: {"train": s},
], ids=["lightning", "plain-loop", "data-entry"])
def test_a_whole_checkpoint_resumes_as_its_state(nomlm_dataset: Path, state: dict[str, Any], wrap: Any) -> None:
    """Before: the whole Lightning checkpoint handed to load_state_dict raised KeyError: 'fingerprint'."""
    want, got = loader(nomlm_dataset), loader(nomlm_dataset)
    want.load_state_dict(state)
    got.load_state_dict(wrap(state))
    assert got.position == want.position == Position(0, 2)
    assert [b["person_id"].tolist() for b in got] == [b["person_id"].tolist() for b in want]


def refused(root: Path, value: Any, needle: str) -> str:
    """The one-line ValueError ``load_state_dict(value)`` raises, which must hold ``needle``."""
    with pytest.raises(ValueError) as err:
        loader(root).load_state_dict(value)
    said = str(err.value)
    assert needle in said and len(said.splitlines()) == 1, said
    return said


def test_two_states_say_which_key_to_pass(nomlm_dataset: Path, state: dict[str, Any]) -> None:
    said = refused(nomlm_dataset, {"a": {"train": state}, "b": {"train": state}}, "holds 2 loader states")
    assert "['a']['train']" in said and "['b']['train']" in said and "pass the one to resume" in said


@pytest.mark.parametrize("value", [{"state_dict": {}}, {}, [1, 2], "state"])
def test_no_state_is_refused(nomlm_dataset: Path, value: Any) -> None:
    refused(nomlm_dataset, value, "holds no loader states")


def damaged(state: dict[str, Any], edit: Any) -> dict[str, Any]:
    out = copy.deepcopy(state)
    edit(out)
    return out


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda s: s.pop("layout"), "has no 'layout'"),
    (lambda s: s.pop("batches"), "has no 'batches'"),
    (lambda s: s.pop("fingerprint"), "has no 'fingerprint'"),
    (lambda s: s.update(epoch="x"), "has epoch 'x', not an integer >= 0"),
    (lambda s: s.update(epoch=-1), "has epoch -1, not an integer >= 0"),
    (lambda s: s.update(batches=2.5), "has batches 2.5, not an integer >= 0"),
    (lambda s: s.update(fingerprint=None), "has fingerprint None, not a string"),
    (lambda s: s.update(layout=[]), "has layout [], not a dict"),
    (lambda s: s["layout"].update(world_size=0), "has layout['world_size'] 0, not an integer >= 1"),
    (lambda s: s["layout"].update(batch_size="64"), "has layout['batch_size'] '64', not an integer >= 1"),
    (lambda s: s["layout"].update(mode="fast"), "has layout['mode'] 'fast', not one of"),
    (lambda s: s["layout"].update(split="train"), "has layout['split'] 'train', not a non-empty list"),
    (lambda s: s["layout"].update(shuffle="yes"), "has layout['shuffle'] 'yes', not True or False"),
    (lambda s: s.update(history=[{"batches": 3}]), "has history[0] {'batches': 3}, not a leg"),
    (lambda s: s.update(history=[{**s["layout"], "world_size": 0, "batches": 3}]),
     "has history[0]['world_size'] 0, not an integer >= 1"),
    (lambda s: s.update(version=99), "has version 99, and this lifeseq_shards reads versions 1 to 5: upgrade"),
    (lambda s: s.update(version="2"), "has version '2'"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_damaged_state_is_refused_naming_the_key(nomlm_dataset: Path, state: dict[str, Any], edit: Any,
                                                   needle: str) -> None:
    """Before: KeyError: 'layout', invalid literal for int(), and a saved arrangement of 0 ranks read as the user's own
    setting (world_size must be >= 1, got 0)."""
    for value, where in ((damaged(state, edit), ""), ({"data": {"train": damaged(state, edit)}}, " ['data']['train']")):
        said = refused(nomlm_dataset, value, needle)
        assert said.startswith(f"{nomlm_dataset}: the checkpoint's loader state{where} "), said


def test_a_state_without_a_version_is_version_1(nomlm_dataset: Path, state: dict[str, Any]) -> None:
    old = {k: v for k, v in state.items() if k not in ("version", "digest")}  # as saved before either key
    ld = loader(nomlm_dataset)
    ld.load_state_dict(old)
    assert ld.position == Position(0, 2)


def test_shardify_plan_resume_refuses_a_damaged_state(nomlm_dataset: Path, state: dict[str, Any],
                                                      tmp_path: Path) -> None:
    torch.save({"LifeSeqDataModule": {"train": damaged(state, lambda s: s.update(epoch="x"))}}, tmp_path / "x.ckpt")
    code, out = shardify("plan", nomlm_dataset, "--batch-size", 64, "--resume", tmp_path / "x.ckpt")
    want = f"{tmp_path / 'x.ckpt'}: the checkpoint's loader state ['LifeSeqDataModule']['train'] has epoch 'x'"
    assert code == 2 and len(out.strip().splitlines()) == 1 and re.search(re.escape(want), out), out


def budget_state(root: Path) -> dict[str, Any]:
    """A token budget's state 3 batches into epoch 0 of rank 0 of 1, through pickle as a checkpoint stores it."""
    ld = ShardedLoader(ShardedDataset(root, world=World(0, 1), tokens_per_batch=8000))
    batches = iter(ld)
    list(itertools.islice(batches, 3))
    saved = pickle.loads(pickle.dumps(ld.state_dict()))
    del batches
    return saved


@pytest.mark.parametrize("edit", [
    lambda s: s["layout"].update(tokens_per_batch=6000),  # the issue's: read 15 persons twice, every check passed
    lambda s: s.update(batches=s["batches"] + 1),
    lambda s: s["layout"].update(seed=s["layout"]["seed"] + 1),
    lambda s: s.update(history=[{**s["layout"], "batches": 2}]),
    lambda s: s.update(left_out_before=[3]),
    lambda s: s.pop("digest"),  # a version 5 state without its digest
    lambda s: s.update(digest="0" * 64),
], ids=["tokens_per_batch", "batches", "seed", "history", "left_out_before", "no-digest", "other-digest"])
def test_an_edited_state_is_refused_by_its_digest(nomlm_dataset: Path, edit: Any) -> None:
    """Issue 40: a budget state whose tokens_per_batch was changed by hand passed every check, and 15 persons were
    read twice. Every well-formed edit is now refused in one line; the state as saved still resumes."""
    state = budget_state(nomlm_dataset)
    assert state["version"] == 5 and len(state["digest"]) == 64
    fresh = ShardedLoader(ShardedDataset(nomlm_dataset, world=World(0, 1), tokens_per_batch=8000))
    fresh.load_state_dict(state)
    assert fresh.position == Position(0, 3)
    ld = ShardedLoader(ShardedDataset(nomlm_dataset, world=World(0, 1), tokens_per_batch=8000))
    with pytest.raises(ValueError) as err:
        ld.load_state_dict(damaged(state, edit))
    said = str(err.value)
    assert "does not match its digest: it was edited or damaged" in said and "\n" not in said, said


def test_a_persons_state_carries_a_digest_and_one_saved_before_reads_as_before(nomlm_dataset: Path,
                                                                               state: dict[str, Any]) -> None:
    """Batches of persons: still version 2 with the keys it had, and the digest; an edit is refused, and a state
    without a digest (saved before it, e.g. tests/data/*.ckpt) resumes as before."""
    assert state["version"] == 2 and len(state["digest"]) == 64
    refused(nomlm_dataset, damaged(state, lambda s: s.update(batches=3)), "does not match its digest")
    ld = loader(nomlm_dataset)
    ld.load_state_dict({k: v for k, v in state.items() if k != "digest"})
    assert ld.position == Position(0, 2)
