"""The reader: DDP/worker partition, epochs, exact resume, batch contents, remote shards, rank capture, workers
that die with a killed process, positions and arguments refused.

Expectations come from the files, not from the reader's code path: person ids are decoded by hand from the shard
tars (the documented block layout), values are compared with the seed's h5 rows, counts are worked out from the
fixture's layout (48 train shards x 115 persons + a 45-person remainder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    U16,
    SeedRows,
    group_pids,
    repo_first,
    scaled,
    serve_directory,
    shard_ids,
    shm_files,
    split_ids,
    trained_ids,
    wait_for,
)
from torch.utils.data import DataLoader

from lifeseq_shards import reader
from lifeseq_shards.deprecation import LifeSeqDeprecationWarning
from lifeseq_shards.device.batch import PackedBatch, PaddedBatch
from lifeseq_shards.device.build import model_batch, padded_fields
from lifeseq_shards.plan.resume import Position
from lifeseq_shards.plan.slots import Segment
from lifeseq_shards.reader import DatasetChanged, ShardedDataset, ShardedLoader, World, read_segment
from lifeseq_shards.reader.options import ReadOptions
from lifeseq_shards.reader.transport import PIPE_BYTES
from lifeseq_shards.store.format import token_schema
from lifeseq_shards.store.manifest import ManifestError, ShardEntry, fingerprint, write_manifest
from lifeseq_shards.store.remote import STALL_ENV, read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks, write_shard

Batch = PaddedBatch | PackedBatch
SHARDS, PER_SHARD, TRAIN_READ = 48, 115, 48 * 115  # the train split of both fixtures (seed 0)
SEED_WIDTH, SEED_TARGETS = 512, 153  # the seed's h5 rows: 512 positions, floor(0.3 * 512) target columns


# -- reading helpers ----------------------------------------------------------------------------------------------
def ids_of(batches: Iterable[Batch]) -> np.ndarray:
    return np.concatenate([b.tensors["person_id"].numpy() for b in batches])


def rank_pass(root: Path | str, world: int, rank: int, workers: int, epoch: int = 0, split: str = "train",
              batches_per_message: int | None = None, **kw: Any) -> tuple[list[Batch], int]:
    """One epoch of one rank as a DDP rank reads it (through its own DataLoader workers when workers > 0)."""
    ds = ShardedDataset(root, split=split, world=World(rank, world), num_workers=workers, **kw)
    ds.set_epoch(epoch)
    source: Iterable[Batch] = (ShardedLoader(ds, persistent_workers=False, batches_per_message=batches_per_message)
                               if workers else ds)
    return list(source), len(ds)


def all_ranks(root: Path, world: int, workers: int, epoch: int = 0, **kw: Any) -> list[list[Batch]]:
    """Every rank's epoch; checks the DDP invariant that each rank yields exactly len(ds), the same on all ranks."""
    passes = [rank_pass(root, world, r, workers, epoch, **kw) for r in range(world)]
    lens = {n for _, n in passes}
    assert len(lens) == 1, f"ranks disagree on len(): {lens}"
    for r, (got, n) in enumerate(passes):
        assert len(got) == n, f"rank {r} yielded {len(got)} batches, len() says {n}"
    return [got for got, _ in passes]


def loader(root: Path | str, **kw: Any) -> ShardedLoader:
    return ShardedLoader(ShardedDataset(root, **kw))


def values_of(batch: Batch | dict[str, torch.Tensor]) -> dict[str, Any]:
    """A batch's values by name: a padded host batch's tensors and columns, a packed one's buffer, layout and
    widths, or the named tensors of ``padded_fields``."""
    if isinstance(batch, PaddedBatch):
        return {**batch.tensors, "columns": batch.columns}
    if isinstance(batch, PackedBatch):
        return {"packed": batch.buffer, "spans": batch.spans, "width": batch.width,
                "targets_width": batch.targets_width}
    return batch


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want), f"{len(got)} batches, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = values_of(a), values_of(b)
        assert a.keys() == b.keys(), i
        for k in a:
            if not isinstance(a[k], torch.Tensor):  # the layout: columns, spans, widths
                assert a[k] == b[k], f"batch {i} {k}: {a[k]} != {b[k]}"
                continue
            assert a[k].dtype == b[k].dtype, f"batch {i} field {k}: {a[k].dtype} != {b[k].dtype}"
            # numpy: torch.equal is very slow on uint16 tensors
            assert np.array_equal(a[k].numpy(), b[k].numpy()), f"batch {i} field {k} differs"


# -- 1. train partition over ranks and workers -------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_train_ranks_read_every_person_once_the_remainder_too(mlm_dataset: Path, world: int, workers: int) -> None:
    _, rem = split_ids(mlm_dataset, "train")
    everyone, unread = trained_ids(mlm_dataset, world, workers, 0)
    bs = 128
    slots = world * max(1, workers)
    lost = (TRAIN_READ + len(rem)) % slots  # fewer than the slots: the persons that do not divide among them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 48 shards divide world x workers here: no warning
        ranks = all_ranks(mlm_dataset, world, workers, batch_size=bs)
    got = ids_of(b for r in ranks for b in r)
    assert len(got) == len(np.unique(got)) == TRAIN_READ + len(rem) - lost == len(everyone) - len(unread)
    assert set(got.tolist()) & set(rem.tolist()), "training skipped the remainder"
    assert set(got.tolist()) == everyone - unread  # the ones the plan names are left out
    assert len(ranks[0]) == max(1, workers) * -(-(TRAIN_READ + len(rem)) // slots // bs)


def test_a_non_dividing_worker_count_is_said_once_on_rank_0_with_the_counts_that_divide(mlm_dataset: Path) -> None:
    """Workers that do not divide the shards as converted: rank 0 says so at construction, naming the worker counts
    that divide them on this many ranks; the other ranks, in the same arrangement, say nothing (one line a job, not one
    a rank)."""
    shards = len(read_manifest(str(mlm_dataset)).splits["train"].shards)
    world, workers = 2, 5
    assert shards % (world * workers), "the arrangement must not divide for this test"
    fits = [w for w in range(1, 17) if shards % (world * w) == 0]  # counted here, not by the reader
    with pytest.warns(UserWarning, match=rf"num_workers that divide them on {world} ranks: "
                                         rf"{', '.join(map(str, fits))};.*tune-gpu\.md") as said:
        ShardedDataset(mlm_dataset, world=World(0, world), num_workers=workers)
    assert len([w for w in said if "do not divide" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedDataset(mlm_dataset, world=World(1, world), num_workers=workers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "workers"), [(7, 0), (5, 2)])
def test_train_non_dividing_arrangement_warns_and_stays_balanced(mlm_dataset: Path, world: int, workers: int) -> None:
    slots = world * max(1, workers)
    shards, rem = split_ids(mlm_dataset, "train")
    total = TRAIN_READ + len(rem)
    lost = total % slots  # every train person, remainder included, that does not divide into the slots
    said = rf"\b{lost} persons are left out" if lost else "no person is left out"
    with pytest.warns(UserWarning, match=rf"45-person remainder shard included: {said}"):
        ShardedDataset(mlm_dataset, world=World(0, world), num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = all_ranks(mlm_dataset, world, workers, batch_size=64)
    got = ids_of(b for r in ranks for b in r)
    assert len(got) == len(np.unique(got)) == total - lost
    assert set(got.tolist()) <= set(np.concatenate([*shards, rem]).tolist())


@pytest.mark.timeout(180)
def test_over_two_epochs_every_train_person_is_read(mlm_dataset: Path) -> None:
    """8 ranks: 5,565 train persons (48 shards of 115 + a remainder of 45) leave 5 out of each epoch; the next epoch
    leaves out 5 others, so two epochs read every person of the split (counted from the shard files)."""
    world = 8
    shards, rem = split_ids(mlm_dataset, "train")
    everyone = set(np.concatenate([*shards, rem]).tolist())
    lost = len(everyone) % world
    assert lost, "the fixture should leave someone out, or this test checks less than it says"
    left, seen = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in (0, 1):
            got = ids_of(b for r in all_ranks(mlm_dataset, world, 0, epoch, batch_size=256) for b in r)
            assert len(got) == len(set(got.tolist())) == len(everyone) - lost
            assert set(got.tolist()) <= everyone
            left.append(everyone - set(got.tolist()))
            seen |= set(got.tolist())
    assert len(left[0]) == len(left[1]) == lost
    assert not left[0] & left[1], "a person left out two epochs running"
    assert seen == everyone, "a train person was read in neither epoch"


# -- 2. epochs ----------------------------------------------------------------------------------------------------
def test_epochs_reshuffle_and_reproduce(mlm_dataset: Path) -> None:
    def fresh(epoch: int, seed: int = 0) -> list[Batch]:
        ds = ShardedDataset(mlm_dataset, batch_size=256, world=World(0, 1), seed=seed)
        ds.set_epoch(epoch)
        return list(ds)

    ds = ShardedDataset(mlm_dataset, batch_size=256, world=World(0, 1))
    e0, e1 = list(ds), list(ds)
    assert sorted(ids_of(e0)) == sorted(ids_of(e1))
    assert not np.array_equal(ids_of(e0), ids_of(e1)), "epoch 1 repeats epoch 0's order"
    assert_same_batches(fresh(0), e0)
    assert_same_batches(fresh(1), e1)
    ds.set_epoch(5)
    e5 = list(ds)
    assert_same_batches(fresh(5), e5)
    assert_same_batches(list(ds), fresh(6))
    assert not np.array_equal(ids_of(fresh(0, seed=1)), ids_of(e0)), "the seed does not change the order"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_see_each_epoch(mlm_dataset: Path, context: str) -> None:
    """spawn (and forkserver, Python 3.14's default) pickle the dataset: the epoch must reach workers anyway."""
    def fresh(epoch: int) -> list[Batch]:
        return rank_pass(mlm_dataset, 1, 0, 2, epoch, batch_size=256)[0]

    ld = ShardedLoader(ShardedDataset(mlm_dataset, batch_size=256, num_workers=2), multiprocessing_context=context)
    assert ld.persistent_workers
    p0, p1 = list(ld), list(ld)
    ld.set_epoch(5)
    p5 = list(ld)
    del ld
    assert not np.array_equal(ids_of(p0), ids_of(p1)), "persistent workers repeated epoch 0"
    for epoch, got in ((0, p0), (1, p1), (5, p5)):
        assert_same_batches(got, fresh(epoch))


# -- 3. inference -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_message", [1, 3])
def test_inference_reads_everyone_once_in_file_order(mlm_dataset: Path, per_message: int) -> None:
    world, workers, bs = 3, 2, 100
    shards, rem = split_ids(mlm_dataset, "train")
    files = [*shards, rem]
    slots = world * workers
    everyone: list[np.ndarray] = []
    for rank in range(world):
        # each slot reads whole files j, j + slots, ... in file order; its DataLoader alternates its workers, a
        # message of per_message batches from each in turn
        streams = [np.concatenate(files[rank * workers + w :: slots]) for w in range(workers)]
        chunks = [[s[i : i + bs] for i in range(0, len(s), bs)] for s in streams]
        want = [b for i in range(0, max(map(len, chunks)), per_message) for c in chunks
                for b in c[i : i + per_message]]
        for epoch, shuffle in ((0, None), (1, True)):  # inference never shuffles, even when asked
            got, n = rank_pass(mlm_dataset, world, rank, workers, epoch, mode="complete", batch_size=bs,
                               shuffle=shuffle, batches_per_message=per_message)
            assert len(got) == n == len(want)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g.tensors["person_id"].numpy(), w)
        everyone.append(ids_of(got))
    got_all = np.concatenate(everyone)
    assert len(got_all) == TRAIN_READ + len(rem) == len(np.unique(got_all))
    assert set(got_all.tolist()) == set(np.concatenate(files).tolist())


def test_inference_over_several_splits_embeds_everyone(nomlm_dataset: Path, sample: Path) -> None:
    """What the DataModule's predict reads by default: train and val, remainders included, each person once."""
    with h5py.File(sample / "encoded_nomlm.h5") as h:
        everyone = set(h["sequence_id"][:].tolist())
    got = np.concatenate([ids_of(rank_pass(nomlm_dataset, 3, rank, 0, mode="complete", split=("train", "val"),
                                           batch_size=128)[0]) for rank in range(3)])
    assert len(got) == len(np.unique(got)) == len(everyone) and set(got.tolist()) == everyone
    with pytest.raises(ValueError, match="only in mode='complete'"):
        ShardedDataset(nomlm_dataset, split=("train", "val"))


def test_a_dataset_of_options_reads_as_the_dataset_of_the_same_arguments(nomlm_dataset: Path) -> None:
    """``ShardedDataset(root, options, **changes)`` (what a front end builds each loader with) is the dataset the
    same settings by name build: the same frozen options, plan and batches; the changes are checked again, as the
    settings are."""
    world = World(0, 1)
    made = ShardedDataset(nomlm_dataset, split="train", batch_size=100, world=world, seed=3, pad_to=48)
    options = ReadOptions(batch_size=100, seed=3, pad_to=48)
    again = ShardedDataset(nomlm_dataset, options, world=world, manifest=made.manifest)
    assert again.options == made.options and again.partition == made.partition and again.spec == made.spec
    assert [b.tensors["person_id"].tolist() for b in again] == [b.tensors["person_id"].tolist() for b in made]
    val = ShardedDataset(nomlm_dataset, options, world=world, split="val", mode="exact")
    assert val.options == dataclasses.replace(options, split="val", mode="exact") and options.split == "train"
    assert val.partition == ShardedDataset(nomlm_dataset, split="val", batch_size=100, world=world, seed=3,
                                           mode="exact", pad_to=48).partition
    with pytest.raises(ValueError, match="skip_files and shard_field are for mode='complete'"):
        ShardedDataset(nomlm_dataset, options, world=world, shard_field=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        ShardedDataset(nomlm_dataset, world=world, batchsize=100)


def test_the_split_and_batch_size_by_position_still_read_and_warn(nomlm_dataset: Path) -> None:
    """The old call ``ShardedDataset(root, "val", 64)`` (the guides' form until December 2026) reads what the
    settings by name read, warning once with the form to use; what cannot be meant is refused in one line."""
    world = World(0, 1)
    named = ShardedDataset(nomlm_dataset, split="val", batch_size=64, world=world, mode="exact")
    with pytest.warns(LifeSeqDeprecationWarning, match=r"ShardedDataset\(path, split, batch_size, \.\.\.\) by "
                      r"position is deprecated: use ShardedDataset\(path, split=\.\.\., batch_size=\.\.\.") as said:
        both = ShardedDataset(nomlm_dataset, "val", 64, world=world, mode="exact")
    assert len(said) == 1 and said[0].filename == __file__  # the caller's line, not the package's
    assert both.options == named.options and both.partition == named.partition
    with pytest.warns(LifeSeqDeprecationWarning, match=r"\(path, split, \.\.\.\) by position"):
        one = ShardedDataset(nomlm_dataset, ("val",), world=world, batch_size=64, mode="exact")
    assert one.partition == named.partition
    with pytest.raises(TypeError, match="batch_size both by position and by name"):
        ShardedDataset(nomlm_dataset, "val", 64, world=world, batch_size=32)
    with pytest.raises(TypeError, match="no positional argument after the options; name them"):
        ShardedDataset(nomlm_dataset, ReadOptions(), 64, world=world)
    with pytest.raises(TypeError, match="no positional argument after the options"):
        ShardedDataset(nomlm_dataset, None, 64, world=world)  # not a split of 64
    with pytest.raises(TypeError, match="no third positional argument"):
        ShardedDataset(nomlm_dataset, "val", 64, False, world=world)


# -- 4. exact resume ----------------------------------------------------------------------------------------------
def take(it: Iterator[Batch], n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world", "rank", "workers", "mode", "bs", "mid", "per_message"),
    [
        (1, 0, 0, "balanced", 100, 5, None),
        # the three 2-worker cases of one rank: 6-14 s each (load 2-7): make test runs them, make check not
        pytest.param(1, 0, 2, "balanced", 100, 5, 1, marks=pytest.mark.slow),  # odd: the batch due next is worker 1's
        # inside worker 1's first message of 3 (w0 w0 w0 w1 w1 | w1)
        pytest.param(1, 0, 2, "balanced", 100, 5, 3, marks=pytest.mark.slow),
        # the default, 10 per message: inside worker 0's first
        pytest.param(1, 0, 2, "balanced", 100, 5, None, marks=pytest.mark.slow),
        (7, 3, 0, "balanced", 100, 5, None),  # pooled slices: reads start inside shards
        (3, 0, 2, "complete", 115, 13, 1),  # workers with unequal batch counts (9 and 8)
        (3, 0, 2, "complete", 115, 13, None),  # the same in messages of 8: w0's 8, w1's 8, w0's last one
    ],
)
def test_resume_is_exact(nomlm_dataset: Path, world: int, rank: int, workers: int, mode: str, bs: int,
                         mid: int, per_message: int | None) -> None:
    def make() -> ShardedLoader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = ShardedDataset(nomlm_dataset, batch_size=bs, world=World(rank, world), num_workers=workers,
                                mode=mode)
            return ShardedLoader(ds, batches_per_message=per_message)

    ref = make()
    e0 = list(ref)
    end_state = ref.state_dict()
    e1 = list(ref)
    del ref
    assert mid + 2 < len(e0)

    def resume(state: dict[str, Any]) -> ShardedLoader:
        ld = make()
        ld.load_state_dict(pickle.loads(pickle.dumps(state)))  # as a checkpoint stores it
        return ld

    # mid-epoch 0, preempted again 2 batches after resuming; the pass after the resumed one is epoch 1 in full
    ld = make()
    head = take(iter(ld), mid)
    ld = resume(ld.state_dict())
    head += take(iter(ld), 2)
    ld = resume(ld.state_dict())
    assert_same_batches(head + list(ld), e0)
    assert_same_batches(list(ld), e1)
    # n = 0: a state saved before anything was read
    assert_same_batches(list(resume(make().state_dict())), e0)
    # at the exact end of epoch 0: the next pass is epoch 1
    assert_same_batches(list(resume(end_state)), e1)
    # mid-epoch 1
    ld = make()
    list(ld)
    head = take(iter(ld), 3)
    assert_same_batches(head + list(resume(ld.state_dict())), e1)


def test_resume_refused_once_a_pass_has_begun(nomlm_dataset: Path) -> None:
    """The pass's position is fixed when it begins: a state loaded then would be ignored, replaying or skipping."""
    ld = loader(nomlm_dataset, batch_size=100, world=World(0, 1))
    state = ld.state_dict()
    it = iter(ld)
    ld.load_state_dict(state)  # created, not begun: still fine
    next(it)
    with pytest.raises(RuntimeError, match="after this loader began a pass"):
        ld.load_state_dict(state)
    del it
    ld.load_state_dict(state)  # the pass was closed


def test_set_epoch_after_a_load_keeps_the_position_or_refuses(nomlm_dataset: Path) -> None:
    """A loop's set_epoch at the top of the resumed epoch keeps the loaded position (before: it started the epoch
    over, replaying the batches trained before the checkpoint); another epoch is refused, naming both; once the
    resumed pass has begun set_epoch moves on as it always did. pass_start says where each pass begins."""
    whole = loader(nomlm_dataset, batch_size=100, world=World(0, 1))
    epoch0 = [b["person_id"].tolist() for b in whole]
    ld = loader(nomlm_dataset, batch_size=100, world=World(0, 1))
    take(iter(ld), 3)
    state = ld.state_dict()
    resumed = loader(nomlm_dataset, batch_size=100, world=World(0, 1))
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"goes on in epoch 0 after 3 batches, but set_epoch\(1\) would start"):
        resumed.set_epoch(1)
    resumed.set_epoch(0)
    assert resumed.pass_start == Position(0, 3)
    it = iter(resumed)
    first = next(it)
    assert resumed.pass_start == Position(0, 3) and resumed.position == Position(0, 4)
    rest = [first["person_id"].tolist()] + [b["person_id"].tolist() for b in it]
    assert rest == epoch0[3:]
    assert resumed.pass_start == Position(1, 0)  # after the pass: the next epoch's start
    resumed.set_epoch(5)
    assert resumed.pass_start == resumed.position == Position(5, 0)


def test_resume_refuses_another_dataset(nomlm_dataset: Path, reseeded16: Path) -> None:
    ld = loader(nomlm_dataset, batch_size=100)
    take(iter(ld), 2)
    state = ld.state_dict()
    other = loader(reseeded16, batch_size=100)
    assert other.dataset.fingerprint != ld.dataset.fingerprint
    with pytest.raises(DatasetChanged, match="fingerprint") as err:
        other.load_state_dict(state)
    assert ld.dataset.fingerprint in str(err.value) and other.dataset.fingerprint in str(err.value)


def test_a_message_size_below_one_is_refused(nomlm_dataset: Path) -> None:
    """(Another worker count or message size resumes the rest of the epoch: tests/reader/test_elastic_resume.py.)"""
    with pytest.raises(ValueError, match="batches_per_message must be >= 1"):
        ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, num_workers=2), batches_per_message=0)


# -- 5. batch contents --------------------------------------------------------------------------------------------
def check_batch(b: Batch, seed: SeedRows, width: int | None = None) -> np.ndarray:
    """Compare a batch with the seed's rows of the same persons; returns those rows."""
    rows = seed.rows(b.tensors["person_id"])
    length = seed.length[rows]
    want_width = width or -(-int(length.max()) // 8) * 8
    assert b.tensors["tokens"].shape == (len(rows), want_width)
    np.testing.assert_array_equal(b.tensors["lengths"].numpy(), np.minimum(length, want_width))
    c = seed.cols
    np.testing.assert_array_equal(b.tensors["tokens"].numpy(), c["original_sequence"][rows, :want_width])
    for j, name in enumerate(("abspos", "age", "segment"), start=1):
        np.testing.assert_array_equal(b.tensors[name].numpy(), c["input_ids"][rows, j, :want_width], err_msg=name)
    assert b.tensors["person_id"].dtype == torch.int64 and b.tensors["lengths"].dtype in (torch.int32, torch.int64)
    assert tuple(b.tensors[k].dtype for k in ("tokens", "abspos", "age", "segment")) == (
        U16, torch.int16, torch.uint8, torch.uint8)
    return rows


def test_batches_hold_the_seed_rows_padded_to_multiples_of_8(nomlm_dataset: Path, nomlm_rows: SeedRows) -> None:
    batches = list(ShardedDataset(nomlm_dataset, batch_size=200, world=World(0, 1)))
    assert {b.tensors["tokens"].shape[1] % 8 for b in batches} == {0}
    widths = {b.tensors["tokens"].shape[1] for b in batches}
    assert len(widths) > 1, "every batch has the same width: not padded per batch"
    for b in batches:
        check_batch(b, nomlm_rows)
        assert "masked_tokens" not in b.tensors


def test_pad_to_crops_and_pads(nomlm_dataset: Path, nomlm_rows: SeedRows) -> None:
    batches = list(ShardedDataset(nomlm_dataset, batch_size=200, world=World(0, 1), pad_to=128))
    for b in batches:
        check_batch(b, nomlm_rows, width=128)
    assert (nomlm_rows.length[nomlm_rows.rows(torch.cat([b.tensors["person_id"] for b in batches]))] > 128).any()


def test_offline_mlm_fields(mlm_dataset: Path, mlm_rows: SeedRows) -> None:
    c = mlm_rows.cols
    ds = ShardedDataset(mlm_dataset, split="val", batch_size=64, world=World(0, 1))
    for b in ds:
        rows = check_batch(b, mlm_rows)
        width = b.tensors["tokens"].shape[1]
        np.testing.assert_array_equal(b.tensors["masked_tokens"].numpy(), c["input_ids"][rows, 0, :width])
        n = (c["target_pos"][rows, :SEED_TARGETS] != SEED_WIDTH - 1).sum(axis=1)  # unused targets: position 511
        np.testing.assert_array_equal(b.tensors["n_targets"].numpy(), n)
        assert b.tensors["target_pos"].shape == b.tensors["target_tokens"].shape == (len(rows), n.max())
        used = np.arange(n.max())[None, :] < n[:, None]
        for name in ("target_pos", "target_tokens"):
            np.testing.assert_array_equal(b.tensors[name].numpy(), np.where(used, c[name][rows, : n.max()], 0), name)
        np.testing.assert_array_equal(b.tensors["target_cls"].numpy(), c["target_cls"][rows])
        assert (b.tensors["target_pos"].dtype, b.tensors["target_tokens"].dtype, b.tensors["target_cls"].dtype) == (
            U16, U16, torch.uint8)


def test_offline_mlm_pad_to_gives_the_seeds_batch(mlm_dataset: Path, mlm_rows: SeedRows) -> None:
    """pad_to=512 on an offline-mask dataset: model_batch gives the seed's h5 rows exactly (width 512, 153 target
    slots: unused ones position 511 and token 0)."""
    c = mlm_rows.cols
    for b in ShardedDataset(mlm_dataset, split="val", batch_size=64, world=World(0, 1), pad_to=SEED_WIDTH):
        out, rows = model_batch(b), mlm_rows.rows(b.tensors["person_id"])
        assert out["input_ids"].shape == (len(rows), 4, SEED_WIDTH)
        for name, want in (("input_ids", c["input_ids"][rows]), ("padding_mask", c["padding_mask"][rows]),
                           ("original_sequence", c["original_sequence"][rows]),
                           ("target_pos", c["target_pos"][rows, :SEED_TARGETS]),
                           ("target_tokens", c["target_tokens"][rows, :SEED_TARGETS]),
                           ("target_cls", c["target_cls"][rows])):
            np.testing.assert_array_equal(out[name].numpy(), want, name)


def test_offline_mlm_pad_to_refuses_to_crop_naming_the_person(mlm_dataset: Path, mlm_rows: SeedRows) -> None:
    ds = ShardedDataset(mlm_dataset, split="val", batch_size=64, world=World(0, 1), pad_to=128)
    with pytest.raises(ValueError, match=r"person (\d+) has (\d+) tokens, more than pad_to=128") as err:
        list(ds)
    person, n = (int(x) for x in re.search(r"person (\d+) has (\d+)", str(err.value)).groups())  # type: ignore[union-attr]
    assert mlm_rows.length[mlm_rows.row[person]] == n > 128


def test_partial_reads_of_small_blocks(reseeded16: Path, nomlm_rows: SeedRows) -> None:
    """16-person blocks and pooled slices: reads start and stop inside shards, past their first block."""
    shards, _ = split_ids(reseeded16, "train")
    assert len(shards) == SHARDS
    world = 5  # 3 pooled shards cut into 69-person slices, then the remainder shared out
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = all_ranks(reseeded16, world, 0, batch_size=100)
    for b in (b for r in ranks for b in r):
        check_batch(b, nomlm_rows)
        got.append(b.tensors["person_id"].numpy())
    ids = np.concatenate(got)
    everyone, left = trained_ids(reseeded16, world, 0, 0)
    assert len(ids) == len(np.unique(ids)) == len(everyone) - len(left) > TRAIN_READ
    assert set(ids.tolist()) == everyone - left


# -- 6. worker count mismatch -------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("built_for", "runs_with"), [(2, 1), (2, 0)])
def test_dataloader_with_other_worker_count_fails(nomlm_dataset: Path, built_for: int, runs_with: int) -> None:
    """In a worker (2 -> 1) or in the main process (2 -> 0). One mismatched worker only: torch waits 5 s for each
    worker of a DataLoader whose workers failed before it lets them go (gc.collect charges that here)."""
    ds = ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1), num_workers=built_for)
    with pytest.raises(RuntimeError, match=f"built for num_workers={built_for}.*num_workers={runs_with}"):
        list(DataLoader(ds, batch_size=None, num_workers=runs_with))
    gc.collect()
    with pytest.raises(ValueError, match="num_workers"):
        ShardedLoader(ds, num_workers=runs_with)


# -- 7. remote shards ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_root(nomlm_dataset: Path) -> Iterator[str]:
    with serve_directory(nomlm_dataset) as url:
        yield url


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (7, 2)])
def test_http_shards_read_like_local_ones(nomlm_dataset: Path, http_root: str, world: int, rank: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remote = rank_pass(http_root, world, rank, 0, batch_size=200)
        local = rank_pass(nomlm_dataset, world, rank, 0, batch_size=200)
    assert remote[1] == local[1]
    assert_same_batches(remote[0], local[0])


@pytest.fixture
def stalling_http_root() -> Iterator[str]:
    """A server that answers every request with the start of a body, then sends nothing for a minute."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listening socket closed: the test is over
            while True:
                conn, _ = server.accept()
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 100)
                held.append(conn)  # open and silent

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_http_body_fails_instead_of_hanging(nomlm_dataset: Path, stalling_http_root: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: webdataset's curl waited forever on a server that stopped sending mid-shard (or mid-manifest)."""
    monkeypatch.setenv(STALL_ENV, "1")
    m = read_manifest(nomlm_dataset)
    entry = m.splits["train"].shards[0]
    shard = m.shard_file(entry, f"{stalling_http_root}/{entry.file}")
    t0 = time.monotonic()
    with pytest.raises(OSError, match=re.escape(shard.url)):
        read_segment(Segment(shard, 0, PER_SHARD), m.schema)
    with pytest.raises(ManifestError, match=re.escape(f"{stalling_http_root}/manifest.json: cannot read")):
        read_manifest(stalling_http_root)
    assert time.monotonic() - t0 < 90


def test_pipe_urls_read_shards(nomlm_dataset: Path) -> None:
    """`pipe:` works per shard (the manifest itself is read only from a directory or http(s))."""
    m = read_manifest(nomlm_dataset)
    entry = m.splits["train"].shards[3]
    path = nomlm_dataset / entry.file
    want = shard_ids(path)
    shard = m.shard_file(entry, f"pipe:cat {path}")
    for start, stop in ((0, PER_SHARD), (20, 60)):
        blocks = read_segment(Segment(shard, start, stop), m.schema)
        ids = np.concatenate([b.columns["person_id"] for b in blocks])
        np.testing.assert_array_equal(ids, want[start:stop])


def test_pipe_dataset_root(nomlm_dataset: Path) -> None:
    """A `pipe:` root streams every file, manifest included, through one command with {} for the file name."""
    root = f"pipe:cat {nomlm_dataset}/{{}}"
    remote = rank_pass(root, 2, 1, 0, batch_size=200)
    local = rank_pass(nomlm_dataset, 2, 1, 0, batch_size=200)
    assert remote[1] == local[1]
    assert_same_batches(remote[0], local[0])
    with pytest.raises(ManifestError, match="needs a {}"):
        ShardedDataset(f"pipe:cat {nomlm_dataset}/manifest.json")


# -- 8. rank and world from the environment -----------------------------------------------------------------------
def test_rank_from_env_is_kept(nomlm_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = ShardedDataset(nomlm_dataset, batch_size=200)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    copy = pickle.loads(pickle.dumps(ds))
    want = list(ShardedDataset(nomlm_dataset, batch_size=200, world=World(1, 2)))
    other = list(ShardedDataset(nomlm_dataset, batch_size=200, world=World(0, 2)))
    assert not set(ids_of(want).tolist()) & set(ids_of(other).tolist())
    for d in (ds, copy):
        assert (d.rank, d.world_size) == (1, 2)
        assert_same_batches(list(d), want)


@pytest.mark.parametrize(("env", "want"), [
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, (3, 4)),  # srun without torchrun
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # torchrun under srun
    ({"SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 says there are 4 processes but SLURM_PROCID is not set"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 says there are 2 processes but RANK is not set"),
    ({"SLURM_NTASKS": "1"}, (0, 1)),
    # a rank without its world size: rank 0 read everything as a world of 1 while the others failed
    ({"RANK": "0"}, "RANK=0 is set but WORLD_SIZE is not"),
    ({"SLURM_PROCID": "0"}, "SLURM_PROCID=0 is set but SLURM_NTASKS is not"),
])
def test_rank_from_slurm(nomlm_dataset: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                         want: tuple[int, int] | str) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if isinstance(want, str):
        with pytest.raises(RuntimeError, match=want):
            ShardedDataset(nomlm_dataset, batch_size=200)
        assert ShardedDataset(nomlm_dataset, batch_size=200, world=World(0, 1)).rank == 0  # explicit wins
        return
    ds = ShardedDataset(nomlm_dataset, batch_size=200)
    assert (ds.rank, ds.world_size) == want
    assert_same_batches(list(ds), list(ShardedDataset(nomlm_dataset, batch_size=200, world=World(want[0], want[1]))))


def test_workers_keep_a_window_in_flight_through_a_wide_pipe(nomlm_dataset: Path) -> None:
    """A worker pauses while it loads its next window; the in-order DataLoader then waits on it while the others
    idle, unless every worker has at least a window's batches in flight. Without the rings, each message (a few
    batches) crosses the workers' result pipe in one write only if the pipe holds it whole (Linux's 64 KiB default
    does not hold one 200 KB batch)."""
    ds = ShardedDataset(nomlm_dataset, batch_size=64, num_workers=1, packed=True)
    loader = ShardedLoader(ds, ring_bytes=0)
    per_message = ds.batches_per_message
    assert per_message > 1 and loader.prefetch_factor * per_message * ds.batch_size >= ds.window
    it = iter(loader)
    message = [next(it) for _ in range(per_message)]
    message_bytes = sum(b.buffer.nbytes for b in message)
    results = loader._iterator._worker_result_queue  # type: ignore[union-attr]  # the persistent workers' queue
    assert fcntl.fcntl(results._reader.fileno(), fcntl.F_GETPIPE_SZ) >= PIPE_BYTES > message_bytes
    del it, loader


def ring_passes(root: Path, ring_bytes: int | None, pause: float = 0.0) -> tuple[list[bytes], ShardedLoader]:
    """Raw packed bytes of: 3 batches of epoch 0 (then abandoned mid-epoch), all of epoch 1, all of epoch 2; a
    ``pause`` after each batch lets the workers run ahead and fill their rings (small messages, ~45 per worker and
    epoch, with a window's worth in flight)."""
    ds = ShardedDataset(root, batch_size=32, num_workers=2, packed=True)
    ld = ShardedLoader(ds, ring_bytes=ring_bytes, batches_per_message=2)
    it = iter(ld)
    got = [next(it).buffer.numpy().tobytes() for _ in range(3)]
    for _ in range(2):
        for b in ld:
            got.append(b.buffer.numpy().tobytes())
            time.sleep(pause)
    return got, ld


@pytest.mark.timeout(120)
def test_workers_hand_packed_batches_over_shared_memory_rings(nomlm_dataset: Path) -> None:
    """The same bytes as through the pipe, batch for batch: with the default ring, with a ring small enough that
    writers wrap and wait for the main process, and with one too small for a message (which then takes the pipe).
    A pass abandoned mid-epoch leaves batches in the ring that nobody copies; the next passes must not wait on
    them (persistent workers) nor read them."""
    want, pipe = ring_passes(nomlm_dataset, 0)
    assert pipe.dataset.rings is None
    got, ring = ring_passes(nomlm_dataset, None)
    assert ring.dataset.rings is not None and ring.ring_bytes > 0
    assert got == want
    message = max(len(b) for b in want) * ring.dataset.batches_per_message
    got_small, small = ring_passes(nomlm_dataset, int(2.5 * message), pause=0.002)
    assert got_small == want
    ctl = small.dataset.ring_ctl
    assert ctl is not None and int(ctl[1:].min()) > 20 * small.ring_bytes  # each worker went round its ring
    assert ring_passes(nomlm_dataset, message)[0] == want  # under twice a message: the pipe


@pytest.mark.timeout(120)
def test_abandoned_iterator_frees_workers_waiting_on_their_rings(nomlm_dataset: Path) -> None:
    """Without persistent workers the DataLoader joins its workers when an abandoned iterator goes (5 s timeout
    each): the workers, blocked on full rings, must be told to stop waiting before that, not after."""
    ds = ShardedDataset(nomlm_dataset, batch_size=32, num_workers=2, packed=True)
    probe = list(ShardedLoader(ds, ring_bytes=0, batches_per_message=2, persistent_workers=False))
    message = max(b.buffer.nbytes for b in probe) * 2
    ld = ShardedLoader(ds, ring_bytes=int(2.5 * message), batches_per_message=2, persistent_workers=False)
    for _ in range(2):
        it = iter(ld)
        next(it)
        time.sleep(1.0)  # both workers fill their rings and wait for the main process
        ctl = ds.ring_ctl
        assert ctl is not None and int(ctl[1:].min()) < 2 * message  # the main process copied out one batch at most
        start = time.perf_counter()
        del it
        gc.collect()
        assert time.perf_counter() - start < 3.0
    assert len(list(ld)) == len(probe)  # and the next pass reads the epoch whole


@pytest.mark.slow
def test_rings_fall_back_to_the_pipe_when_shared_memory_is_short(nomlm_dataset: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """...and a resumed run on a node with less shared memory still gets the same message size (the batch order)."""
    roomy = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=64, num_workers=2, packed=True))
    monkeypatch.setattr(reader.loader.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(64 << 20, 63 << 20, 1 << 20))
    ds = ShardedDataset(nomlm_dataset, batch_size=64, num_workers=2, packed=True)
    ld = ShardedLoader(ds, persistent_workers=False)
    with pytest.warns(UserWarning, match="--shm-size"):
        got = np.concatenate([padded_fields(b)["person_id"].numpy() for b in ld])
    assert ds.rings is None and ld.ring_bytes == 0
    assert ld.state_dict()["layout"] == roomy.state_dict()["layout"]
    everyone, left = trained_ids(nomlm_dataset, 1, 2, 0)
    assert sorted(got.tolist()) == sorted(everyone - left)


@pytest.mark.slow
def test_shared_memory_short_on_a_later_pass_moves_to_the_pipe(nomlm_dataset: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that restart each pass get no rings once /dev/shm runs short: the whole epoch comes through the pipes."""
    ds = ShardedDataset(nomlm_dataset, batch_size=64, num_workers=2, packed=True)
    ld = ShardedLoader(ds, persistent_workers=False)
    (everyone, left0), (_, left1) = (trained_ids(nomlm_dataset, 1, 2, epoch) for epoch in (0, 1))
    first = np.concatenate([padded_fields(b)["person_id"].numpy() for b in ld])
    assert ld.ring_bytes > 0 and sorted(first.tolist()) == sorted(everyone - left0)
    monkeypatch.setattr(reader.loader.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(64 << 20, 63 << 20, 1 << 20))
    with pytest.warns(UserWarning, match="--shm-size"):
        second = np.concatenate([padded_fields(b)["person_id"].numpy() for b in ld])
    assert ds.rings is None and ld.ring_bytes == 0
    assert sorted(second.tolist()) == sorted(everyone - left1)


def test_loader_refuses_out_of_order_workers(nomlm_dataset: Path) -> None:
    with pytest.raises(ValueError, match="in_order=True"):
        ShardedLoader(ShardedDataset(nomlm_dataset, num_workers=2, packed=True), in_order=False)


def format1_copy(root: Path, out: Path) -> Path:
    """The same dataset in format 1 (stamps once per token, no runs), written with the format's own functions."""
    m = read_manifest(root)
    flat = token_schema(m.schema)

    def rewrite(e: ShardEntry) -> ShardEntry:
        (out / e.file).parent.mkdir(parents=True, exist_ok=True)
        stats = write_shard(out / e.file, list(read_shard_blocks(root / e.file, m.schema)), flat)
        return ShardEntry(**{**stats, "file": e.file, "head_checksum": None})  # format 3's checksum

    splits = {name: dataclasses.replace(s, shards=tuple(map(rewrite, s.shards)),
                                        remainder=s.remainder and rewrite(s.remainder)) for name, s in m.splits.items()}
    old = dataclasses.replace(m, format_version=1, schema=tuple(flat), splits=splits)
    write_manifest(out, dataclasses.replace(old, fingerprint=fingerprint(flat, [e.sha256 for _, e in old.entries()])))
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_format1_datasets_read_like_format2(mlm_dataset: Path, tmp_path: Path, packed: bool) -> None:
    """Datasets converted before runs (format 1) still read, into the same batches, packed or padded."""
    old = format1_copy(mlm_dataset, tmp_path)
    assert any(f["name"] == "run_length" for f in json.loads((mlm_dataset / "manifest.json").read_text())["schema"])
    new_batches, _ = rank_pass(mlm_dataset, 2, 1, 0, batch_size=100, packed=packed)
    old_batches, _ = rank_pass(old, 2, 1, 0, batch_size=100, packed=packed)
    if packed:  # the buffers differ (runs vs tokens); what the device makes of them does not
        new_batches, old_batches = ([padded_fields(b) for b in bs] for bs in (new_batches, old_batches))
    assert_same_batches(old_batches, new_batches)


def test_a_damaged_shard_is_named(nomlm_dataset: Path, tmp_path: Path) -> None:
    """A flipped byte fails the block's zstd checksum; the error names the shard and the block, in one line."""
    copy = tmp_path / "ds"
    shutil.copytree(nomlm_dataset, copy)
    shard = copy / "train" / "shard-000003.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's compressed bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"train/shard-000003\.tar: block 0: ") as err:
        rank_pass(copy, 1, 0, 0, batch_size=256)
    assert "\n" not in str(err.value)


# -- 9. names before issue 14 -------------------------------------------------------------------------------------
def test_old_mode_names_and_reader_names_fail_plainly(nomlm_dataset: Path) -> None:
    """mode="train" / "inference" are refused in one line naming the new mode; reader.TRAIN / INFERENCE / Piece and
    read_piece are gone (AttributeError). The saved layout still records the old mode names, so checkpoints saved
    before the rename resume."""
    for old, new in (("train", "balanced"), ("inference", "complete")):
        with pytest.raises(ValueError, match=rf"^mode='{old}' is renamed: use mode='{new}'$"):
            loader(nomlm_dataset, batch_size=200, world=World(1, 2), mode=old)
        now = loader(nomlm_dataset, batch_size=200, world=World(1, 2), mode=new)
        assert now.state_dict()["layout"]["mode"] == old
    for name in ("TRAIN", "INFERENCE", "Piece", "read_piece"):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(reader, name)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_read_from_stdin_is_refused_in_one_line(mlm_dataset: Path) -> None:
    """The forkserver re-runs the main script in each worker, and `python - <<EOF` has none to re-run: its workers
    died with "No such file or directory: '.../<stdin>'" and torch's "DataLoader worker exited unexpectedly"."""
    script = ("from lifeseq_shards.reader import ShardedDataset, ShardedLoader\n"
              f"ds = ShardedDataset({str(mlm_dataset)!r}, batch_size=256, num_workers=2)\n"
              "print(sum(1 for _ in ShardedLoader(ds)))\n")
    run = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=scaled(100),
                         env=repo_first(os.environ))
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError:") and "stdin" in last and 'multiprocessing_context="fork"' in last, last
    assert "exited unexpectedly" not in run.stderr
    # fork needs no script to re-run: the same stdin script reads with it
    forked = script.replace("ShardedLoader(ds)", 'ShardedLoader(ds, multiprocessing_context="fork")')
    run = subprocess.run([sys.executable, "-"], input=forked, capture_output=True, text=True, timeout=scaled(100),
                         env=repo_first(os.environ))
    assert run.returncode == 0 and int(run.stdout.split()[-1]) > 0, run.stderr


# -- 10. a killed training process takes everything it started along --------------------------------------------------
SHM = Path("/dev/shm")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not SHM.is_dir(), reason="Linux /dev/shm and /proc")
def test_a_killed_training_process_leaves_nothing_behind(nomlm_dataset: Path) -> None:
    """`python train.py | tee log` after an out-of-memory kill: the pipe reaches EOF (no forkserver, worker or
    resource tracker keeps it open), no process of the training's group survives, and its semaphores are gone
    from /dev/shm."""
    env = repo_first(os.environ)
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "ddp_scripts" / "train_until_killed.py"),
                             str(nomlm_dataset)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own process group: what it starts is found by group
    assert proc.stdout is not None
    shm: set[Path] = set()
    try:
        for line in proc.stdout:
            if line.startswith(b"READY"):
                break
        else:
            pytest.fail("the training script ended before reading 5 batches")
        started = group_pids(proc.pid) - {proc.pid}
        assert len(started) >= 3, started  # the forkserver, 2 workers (and the resource tracker)
        shm = shm_files(started | {proc.pid})
        assert shm, "expected the loader's queues to hold semaphores in /dev/shm"
        proc.kill()
        proc.wait()
        eof = threading.Event()
        threading.Thread(target=lambda: (proc.stdout.read(), eof.set()), daemon=True).start()  # type: ignore[union-attr]
        assert eof.wait(scaled(20)), f"the pipe stayed open 20 s after the kill: held by {group_pids(proc.pid)}"
        assert wait_for(lambda: not group_pids(proc.pid), 10), f"survivors: {group_pids(proc.pid)}"
        assert wait_for(lambda: not any(p.exists() for p in shm), 10), \
            f"left in /dev/shm: {sorted(p.name for p in shm if p.exists())}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in shm:  # the test's own leftovers only (those its processes had mapped)
            p.unlink(missing_ok=True)


# -- 11. positions and arguments that cannot be: refused when given ---------------------------------------------------
@pytest.mark.parametrize(("call", "needle"), [
    (lambda ds: ds.resume_at(0, len(ds) + 5), r"cannot resume epoch 0 after 61 batches: this rank's epoch has 56 "
                                              r"\(resume at 0\.\.56, or set_epoch\(1\) for the next\)"),
    (lambda ds: ds.resume_at(2, -1), r"cannot resume epoch 2 after -1 batches"),
    (lambda ds: ds.set_epoch(-1), r"epoch -1: epochs are numbered from 0"),
])
def test_a_position_outside_the_epoch_is_refused(nomlm_dataset: Path, call: Callable[[ShardedDataset], None],
                                                 needle: str) -> None:
    """Before: resuming past the epoch's end gave an empty epoch without a word (num_workers=0; workers failed
    with 'batches consumed, but the workers only produce'), a negative epoch numpy's 'expected non-negative
    integer' at the first batch; now the call refuses, naming the dataset."""
    ds = ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1))
    with pytest.raises(ValueError, match=re.escape(str(nomlm_dataset)) + ": " + needle):
        call(ds)
    ds.resume_at(0, len(ds))  # the end of the epoch: nothing left of it
    assert list(ds) == []


@pytest.mark.parametrize(("arg", "value"), [("pad_to", 0), ("pad_to", -8), ("pad_multiple", 0), ("batch_size", 0),
                                            ("batch_size", -1), ("seed", -1), ("window", 0)])
def test_arguments_that_cannot_be_are_refused_at_construction(nomlm_dataset: Path, arg: str, value: int) -> None:
    """Before: pad_to=0 gave batches of persons cropped to no tokens, without a word; the others failed at the first
    batch, in a worker (a ZeroDivisionError, numpy's 'expected non-negative integer') or in ShardedLoader."""
    with pytest.raises(ValueError, match=rf"^{arg} must be an integer >= [01], not {value}$"):
        ShardedDataset(nomlm_dataset, world=World(0, 1), **{arg: value})
