"""Real multi-process DDP tests: torchrun (one node and two simulated nodes) over ShardedLoader, and Lightning's ddp
and ddp_spawn over LifeSeqDataModule, all on CPU with gloo.

The worker scripts (tests/ddp_scripts/) report every batch's person ids per rank; the expected persons are read here
straight from the shard files, not through the reader. Every launch runs in its own process group under a deadline,
so a hang (e.g. ranks with unequal batch counts stuck in a collective) kills the group and fails the test.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from ddp_harness import (
    CKPT_STEP,
    LIGHTNING_S,
    SNAPSHOT_AT,
    SPAWN_CKPT,
    SPAWN_S,
    TORCHRUN,
    TORCHRUN_S,
    WORKERS,
    assert_equal_batches,
    assert_exactly_once,
    assert_resume_exact,
    assert_resumed_exact,
    fit_with_checkpoints,
    flat,
    free_port,
    launch,
    lightning,
    read_ranks,
)
from helpers import split_ids, trained_ids

# The Lightning runs (the ddp_spawn one, SPAWN_RUN, is tests/conftest.py's): each an uninterrupted 2-epoch fit of
# the researcher-style model (OneCycleLR over estimated_stepping_batches, which builds the train loader before a
# checkpoint is restored) whose checkpoints the resume tests start from, each configuration repeated by its resumes.
# Together they cover both Lightning packages, ddp and ddp_spawn, 2 and 0 workers, persistent workers on and off, the
# sanity check on and off, validation mid-epoch, limit_train_batches and limit_val_batches, and mid-epoch,
# inside-a-step and end-of-epoch checkpoints.
# lightning, 2 persistent workers, sanity check; the batch built ahead during each step, as on CUDA by default
DDP_RUN = ("--masking", "dynamic", "--val-check-interval", "0.5", "--prefetch")
ZERO_WORKERS_RUN = ("--flavour", "pytorch_lightning", "--workers", "0", "--limit-train", "30")
INSIDE_STEP = "inside-step.ckpt"


@pytest.fixture(scope="module")
def lightning_ddp(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP_RUN's fit; beside its checkpoints, one saved inside step CKPT_STEP (INSIDE_STEP), as SLURM's requeue does."""
    out = tmp_path_factory.mktemp("ddp") / "result.json"
    return fit_with_checkpoints(ds8, out, *DDP_RUN, "--save-mid-step", str(CKPT_STEP),
                                str(out.parent / "ckpt" / INSIDE_STEP))


@pytest.fixture(scope="module")
def lightning_zero_workers(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_with_checkpoints(ds8, tmp_path_factory.mktemp("zero") / "result.json", *ZERO_WORKERS_RUN)


# ---------------------------------------------------------------------------------------------------------------
# the truth the tests compare with


def test_shard_files_hold_every_input_person_once(ds8: Path, sample: Path) -> None:
    with h5py.File(sample / "encoded_nomlm.h5") as h5:
        inputs = np.asarray(h5["sequence_id"][:]).tolist()
    parts = []
    for split in ("train", "val"):
        shards, remainder = split_ids(ds8, split)
        parts += [*shards, remainder]
    assert sum(map(len, parts)) == len(inputs), "a person in two files, or one missing"
    assert set().union(*parts) == set(inputs)


# ---------------------------------------------------------------------------------------------------------------
# torchrun


@pytest.mark.slow
@pytest.mark.timeout(TORCHRUN_S + 30)
def test_torchrun_two_ranks_read_each_person_once_per_epoch(torchrun_two: Path, ds8: Path) -> None:
    ranks = read_ranks(torchrun_two)
    assert [r["world_size"] for r in ranks] == [2, 2]  # taken from torch.distributed, not passed in
    assert len(split_ids(ds8, "train")[1]) == 5
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in ranks]
        everyone, left = trained_ids(ds8, 2, WORKERS, epoch)  # the remainder is read too, but for 1 a epoch
        assert len(left) == 1
        assert_exactly_once(per_rank, everyone - left)
        assert_equal_batches(per_rank, [r["len"] for r in ranks])
    for r in ranks:
        first, second = (flat(e) for e in r["epochs"])
        assert first != second, "epoch 1 repeated epoch 0's order"
        assert set(first) != set(second), "the shards must be dealt anew each epoch"


@pytest.mark.slow
@pytest.mark.timeout(TORCHRUN_S + 30)
def test_torchrun_resume_mid_epoch_equals_uninterrupted(torchrun_two: Path, ds8: Path, tmp_path: Path) -> None:
    """A fresh run loading each rank's state_dict taken after SNAPSHOT_AT batches yields exactly the rest."""
    out = tmp_path / "resumed.json"
    launch([[*TORCHRUN, "--standalone", "--nproc_per_node=2", "torchrun_reader.py", str(ds8), str(out), "--workers",
             str(WORKERS), "--epochs", "2", "--resume", str(torchrun_two)]], tmp_path, TORCHRUN_S)
    for full, resumed in zip(read_ranks(torchrun_two), read_ranks(out), strict=True):
        assert full["snapshot"]["batches"] == SNAPSHOT_AT
        assert resumed["epochs"][0] == full["epochs"][0][SNAPSHOT_AT:]
        assert resumed["epochs"][1] == full["epochs"][1]


@pytest.mark.slow
@pytest.mark.timeout(TORCHRUN_S + 30)
def test_two_nodes_four_ranks_read_each_person_once(ds8: Path, tmp_path: Path) -> None:
    """Two torchrun agents on localhost as node 0 and node 1 (static rendezvous), 2 ranks each."""
    out, port = tmp_path / "result.json", free_port()
    launch([[*TORCHRUN, "--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", "--master_addr=127.0.0.1",
             f"--master_port={port}", "torchrun_reader.py", str(ds8), str(out), "--workers", str(WORKERS)]
            for node in (0, 1)], tmp_path, TORCHRUN_S)
    ranks = read_ranks(out)
    assert [r["world_size"] for r in ranks] == [4] * 4
    per_rank = [r["epochs"][0] for r in ranks]
    everyone, left = trained_ids(ds8, 4, WORKERS, 0)
    assert_exactly_once(per_rank, everyone - left)
    assert_equal_batches(per_rank, [r["len"] for r in ranks])


# ---------------------------------------------------------------------------------------------------------------
# Lightning


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 30)
def test_lightning_ddp_reads_each_person_once(lightning_ddp: Path, ds8: Path) -> None:
    ranks = read_ranks(lightning_ddp)
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in ("0", "1"):
        everyone, left = trained_ids(ds8, 2, WORKERS, int(epoch))
        assert_equal_batches([r["train"][epoch] for r in ranks], [r["num_training_batches"] for r in ranks])
        assert_exactly_once([r["train"][epoch] for r in ranks], everyone - left)
    # validation: every val person once, remainder included, equal batches (val_loss is logged with sync_dist)
    assert_equal_batches([r["val"] for r in ranks], [r["num_val_batches"][0] for r in ranks])
    assert_exactly_once([r["val"] for r in ranks], set().union(*split_ids(ds8, "val")[0], split_ids(ds8, "val")[1]))
    for r in ranks:  # the seed batch, built on the device by the datamodule, with dynamic MLM targets
        seed = r["model_batch"]
        (ids_dtype, (b, rows, width)), (mask_dtype, mask_shape) = seed["input_ids"], seed["padding_mask"]
        assert (ids_dtype, mask_dtype, rows, mask_shape) == ("torch.int64", "torch.int64", 4, [b, width])
        assert b == 64 and width % 8 == 0
        assert seed["real_tokens"] == seed["lengths"]
        assert seed["targets"] == ["target_cls", "target_pos", "target_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 30)
@pytest.mark.parametrize("ckpt", [f"step={CKPT_STEP}.ckpt", "val-step=22.ckpt", "end-epoch=0.ckpt"])
def test_lightning_ddp_resumes_exactly(lightning_ddp: Path, ds8: Path, tmp_path: Path, ckpt: str) -> None:
    """Mid-epoch: step 7 falls inside worker 1's second message (2 batches per message), so the resumed loader must
    let worker 0 play worker 1 and start inside a message. After the mid-epoch validation at step 22 (the seed's
    checkpoints: val_check_interval=0.5, ModelCheckpoint on val_loss_track). End of epoch: the resume starts epoch 1."""
    assert_resume_exact(lightning_ddp, ds8, ckpt, tmp_path, *DDP_RUN)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_S + 30)
def test_lightning_ddp_spawn_reads_each_person_once(lightning_spawn: Path, ds8: Path) -> None:
    """Spawned ranks and spawned DataLoader workers (no RANK/WORLD_SIZE there) must still split the data."""
    ranks = read_ranks(lightning_spawn)
    for epoch in ("0", "1"):
        everyone, left = trained_ids(ds8, 2, WORKERS, int(epoch))
        assert_equal_batches([r["train"][epoch] for r in ranks], [r["num_training_batches"] for r in ranks])
        assert_exactly_once([r["train"][epoch] for r in ranks], everyone - left)


@pytest.mark.slow
@pytest.mark.timeout(SPAWN_S + 30)
def test_lightning_ddp_spawn_resumes_mid_epoch_exactly(lightning_spawn: Path, lightning_spawn_resumed: Path) -> None:
    assert_resumed_exact(lightning_spawn, SPAWN_CKPT, lightning_spawn_resumed)


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 30)
@pytest.mark.parametrize("ckpt", [f"step={CKPT_STEP}.ckpt", "end-epoch=0.ckpt"])
def test_lightning_zero_workers_limited_epochs_resume_exactly(lightning_zero_workers: Path, ds8: Path,
                                                               tmp_path: Path, ckpt: str) -> None:
    """limit_train_batches=30 ends each epoch 14 batches early: the end-of-epoch checkpoint resumes at the start
    of epoch 1, not at batch 30 of epoch 0."""
    assert [len(e) for e in read_ranks(lightning_zero_workers)[0]["train"].values()] == [30, 30]
    assert_resume_exact(lightning_zero_workers, ds8, ckpt, tmp_path, *ZERO_WORKERS_RUN)


@pytest.mark.slow
@pytest.mark.timeout(2 * LIGHTNING_S + 30)
def test_lightning_ddp_checkpoint_inside_a_step_resumes_exactly(lightning_ddp: Path, ds8: Path, tmp_path: Path) -> None:
    """Lightning's SLURM auto-requeue (SIGUSR1) saves a checkpoint wherever the step stands, and the requeued job
    resumes from it by training that step's batch again: the data must resume at that batch, not after it (the
    resumed run used to stop with "loader is at batch 9 ... trainer at batch 8")."""
    ckpt = lightning_ddp.parent / "ckpt" / INSIDE_STEP
    assert ckpt.exists(), sorted(p.name for p in ckpt.parent.iterdir())
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == CKPT_STEP
    assert_resume_exact(lightning_ddp, ds8, INSIDE_STEP, tmp_path, *DDP_RUN)


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 30)
def test_lightning_ddp_non_dividing_shards_finish_with_equal_batches(ds7: Path, tmp_path: Path) -> None:
    """7 shards over 2 ranks x 2 workers: the pooled tail is sliced; fewer than 4 persons are left out this epoch,
    the ones the plan names."""
    out = tmp_path / "result.json"
    launch([lightning(ds7, out)], tmp_path, LIGHTNING_S)
    ranks = read_ranks(out)
    assert_equal_batches([r["train"]["0"] for r in ranks], [r["num_training_batches"] for r in ranks])
    assert_equal_batches([r["val"] for r in ranks], [r["num_val_batches"][0] for r in ranks])
    shards, _ = split_ids(ds7, "train")
    train = set().union(*shards)
    slots, n = 2 * WORKERS, len(shards[0])
    pooled = len(shards) % slots * n  # persons of the shards that do not go round whole
    assert pooled % slots, "the fixture should leave someone out, or this test checks less than it says"
    seen = flat([b for r in ranks for b in r["train"]["0"]])
    assert len(seen) == len(set(seen)) and set(seen) <= train
    assert len(train) - len(seen) == pooled % slots
    everyone, left = trained_ids(ds7, 2, WORKERS, 0)
    assert set(seen) == everyone - left
    assert_exactly_once([r["val"] for r in ranks], set().union(*split_ids(ds7, "val")[0]))


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 30)
def test_lightning_ddp_predict_embeds_every_person_once_unmasked(ds7: Path, sample: Path, tmp_path: Path) -> None:
    """predict reads train and val with their remainders: every input person exactly once, uneven ranks allowed;
    with a DataModule configured for dynamic masking, each person's tokens as the seed's unmasked file has them
    (no [MASK], no replacement, no reversed or shuffled events) and no MLM targets."""
    out = tmp_path / "result.json"
    launch([lightning(ds7, out, "--predict", "--masking", "dynamic")], tmp_path, LIGHTNING_S)
    ranks = read_ranks(out)
    with h5py.File(sample / "encoded_nomlm.h5") as h:
        ids = h["sequence_id"][:].tolist()
        truth = {i: row[:n].tolist() for i, row, n in zip(ids, h["input_ids"][:, 0], h["padding_mask"][:].sum(1),
                                                          strict=True)}
    assert_exactly_once([[b["ids"] for b in r["predict"]] for r in ranks], set(ids))
    batches = [b for r in ranks for b in r["predict"]]
    assert {tuple(b["keys"]) for b in batches} == {("input_ids", "lengths", "original_sequence", "padding_mask",
                                                    "person_id")}
    got = {i: t for b in batches for i, t in zip(b["ids"], b["tokens"], strict=True)}
    assert got == truth, f"{sum(got[i] != truth[i] for i in truth)} persons predicted on other tokens"
