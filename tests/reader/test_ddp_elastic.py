"""A 2-rank x 2-worker run (gloo, real processes) stopped mid-epoch and resumed on another arrangement: 1 worker, 1
rank, 3 ranks, another batch size. Through a plain loop under torchrun (ShardedLoader.state_dict / load_state_dict) and
through ``trainer.fit(ckpt_path=...)`` with the seed-style module (OneCycleLR over estimated_stepping_batches,
fitted to the new arrangement's steps in on_train_start as docs/reference/ddp.md recommends).

The rest of the epoch must be every person not yet trained on once, in equal batches on every new rank, fewer than
the new readers left out; the next epoch the new arrangement's ordinary one. The truth is the shard files and the
interrupted run's own batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ddp_harness import (
    LIGHTNING_S,
    SNAPSHOT_AT,
    TORCHRUN,
    TORCHRUN_S,
    fit_with_checkpoints,
    flat,
    launch,
    lightning,
    read_ranks,
)
from helpers import trained_ids

STOP = 9  # the Lightning run's mid-epoch checkpoint: step 9 of 44
# (ranks, workers per rank, batch size) resumed in: the old run is 2 x 2 x 64
ARRANGEMENTS = [(2, 1, 64), (1, 2, 64), (3, 2, 64), (2, 2, 48)]
ARRANGEMENT_IDS = ["1-worker", "1-rank", "3-ranks", "batch-48"]


def epoch_of(root: Path, ranks: int, workers: int, epoch: int) -> set[int]:
    """The persons of ``epoch`` for ``ranks`` x ``workers``: every train person, remainder included, but those the
    plan leaves out."""
    everyone, left = trained_ids(root, ranks, workers, epoch)
    return everyone - left


def assert_rest_of_epoch(trained: list[int], rest_per_rank: list[list[list[int]]], epoch: set[int],
                         slots: int) -> None:
    """The rest is every person of ``epoch`` not in ``trained`` once (fewer than ``slots`` left out), in equal
    batches on every rank; with the trained part it is the epoch. With nothing trained: a whole epoch."""
    assert len(trained) == len(set(trained)) and set(trained) <= epoch
    rest = [i for batches in rest_per_rank for i in flat(batches)]
    assert len(rest) == len(set(rest)), f"{len(rest) - len(set(rest))} persons read twice in the rest"
    assert not set(rest) & set(trained), f"{len(set(rest) & set(trained))} persons trained on again"
    assert set(rest) <= epoch
    left = epoch - set(trained) - set(rest)
    assert len(left) < slots, f"{len(left)} persons left out, {slots} readers"
    counts = [len(batches) for batches in rest_per_rank]
    assert len(set(counts)) == 1 and counts[0] > 0, f"batches per rank in the rest {counts}: the all-reduce hangs"


def assert_next_epoch(root: Path, trained: list[int], rest_per_rank: list[list[list[int]]],
                      next_per_rank: list[list[list[int]]], slots: int) -> None:
    """The epoch after a rest: every train person once but fewer than ``slots``, none of them one the resumed epoch
    (``trained``, then the rest) left out: nobody is left out two epochs running."""
    everyone, _ = trained_ids(root, 1, 0, 0)
    assert_rest_of_epoch([], next_per_rank, everyone, slots)
    before = everyone - set(trained) - {i for batches in rest_per_rank for i in flat(batches)}
    after = everyone - {i for batches in next_per_rank for i in flat(batches)}
    assert not before & after, f"left out two epochs running: {sorted(before & after)}"


@pytest.mark.slow
@pytest.mark.timeout(TORCHRUN_S * 2 + 60)
@pytest.mark.parametrize(("ranks", "workers", "batch"), ARRANGEMENTS, ids=ARRANGEMENT_IDS)
def test_plain_loop_resumes_the_rest_of_the_epoch_on_another_arrangement(torchrun_two: Path, ds8: Path, tmp_path: Path,
                                                                    ranks: int, workers: int, batch: int) -> None:
    full = read_ranks(torchrun_two)
    assert full[0]["snapshot"]["batches"] == SNAPSHOT_AT and full[0]["world_size"] == 2
    out = tmp_path / "resumed.json"
    launch([[*TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "torchrun_reader.py", str(ds8), str(out),
             "--workers", str(workers), "--batch-size", str(batch), "--epochs", "2", "--resume", str(torchrun_two)]],
           tmp_path, TORCHRUN_S)
    resumed = read_ranks(out)
    assert len(resumed) == ranks
    trained = [i for r in full for i in flat(r["epochs"][0][:SNAPSHOT_AT])]
    assert_rest_of_epoch(trained, [r["epochs"][0] for r in resumed], epoch_of(ds8, 2, 2, 0), ranks * max(workers, 1))
    # the next epoch is this arrangement's own but for whom it leaves out: everyone once (fewer than the readers left
    # out where the 8 shards do not divide among them), none of those epoch 0 left out, len() batches on every rank
    assert_next_epoch(ds8, trained, [r["epochs"][0] for r in resumed], [r["epochs"][1] for r in resumed],
                      ranks * max(workers, 1))
    assert {len(r["epochs"][1]) for r in resumed} == {r["len"] for r in resumed}


@pytest.fixture(scope="module")
def lightning_two(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x 2 workers, 2 epochs, no validation, a checkpoint every STOP steps."""
    return fit_with_checkpoints(ds8, tmp_path_factory.mktemp("elastic") / "result.json", "--no-val",
                                "--ckpt-every", str(STOP))


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S * 2 + 60)
@pytest.mark.parametrize(("ranks", "workers", "batch"), ARRANGEMENTS, ids=ARRANGEMENT_IDS)
def test_lightning_fit_resumes_the_rest_of_the_epoch_on_another_arrangement(lightning_two: Path, ds8: Path,
                                                                       tmp_path: Path, ranks: int, workers: int,
                                                                       batch: int) -> None:
    ckpt = lightning_two.parent / "ckpt" / f"step={STOP}.ckpt"
    assert int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]) == STOP
    out = tmp_path / "resumed.json"
    launch([[*lightning(ds8, out, "--no-val", "--epochs", "2", "--resume", str(ckpt)), "--devices", str(ranks),
             "--workers", str(workers), "--batch-size", str(batch)]], tmp_path, LIGHTNING_S)
    full, resumed = read_ranks(lightning_two), read_ranks(out)
    assert len(resumed) == ranks
    trained = [i for r in full for i in flat(r["train"]["0"][:STOP])]
    assert_rest_of_epoch(trained, [r["train"]["0"] for r in resumed], epoch_of(ds8, 2, 2, 0), ranks * max(workers, 1))
    assert_next_epoch(ds8, trained, [r["train"]["0"] for r in resumed], [r["train"]["1"] for r in resumed],
                      ranks * max(workers, 1))
    for r in resumed:
        assert len(r["train"]["1"]) == r["num_training_batches"], "epoch 1 is this arrangement's whole epoch"
        assert_counted_in_steps(r)
        assert_schedule_fits(full[0], r)


def assert_counted_in_steps(resumed: dict[str, Any]) -> None:
    """Lightning numbers the resumed rest of the epoch in this arrangement from its first step on (batch_idx in
    on_train_batch_start and _end, the batches processed after it: a progress bar's count), one a step up to the
    arrangement's last batch, and the next epoch from 0 (it jumped from the checkpoint's count to this arrangement's
    after the first step: 23/88, then 46/88)."""
    n = resumed["num_training_batches"]
    for epoch, steps in resumed["train_counts"].items():
        first = n - len(resumed["train"][epoch]) if epoch == "0" else 0
        assert steps == [[i, i, i + 1] for i in range(first, n)], f"epoch {epoch}: (batch_idx, batch_idx, processed)"


def assert_schedule_fits(full: dict[str, Any], resumed: dict[str, Any]) -> None:
    """The OneCycleLR ran to its last step exactly (no 'Tried to step' error, nothing left), and went on near the
    learning rate it had stopped at."""
    last_epoch, total_steps, estimated = resumed["schedule"]
    assert last_epoch == total_steps == estimated
    before, after = full["lrs"][STOP - 1 : STOP + 1], resumed["lrs"][0]
    assert min(before) * 0.9 <= after <= max(before) * 1.1, f"lr {after} after resuming, {before} around the stop"
    assert np.isclose(resumed["lrs"][-1], full["lrs"][-1], rtol=0.5), "the cycle ends where a full one ends"
