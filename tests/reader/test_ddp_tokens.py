"""Token-budget training batches in real multi-process runs: Lightning DDP (2 ranks x 2 workers, the
researcher-style model, OneCycleLR over estimated_stepping_batches) and torchrun, killed mid-epoch and resumed in
the same arrangement, in another arrangement and in another budget: every train person once an epoch, the same batches
on every rank, no batch over the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_harness import (
    CKPT_STEP,
    LIGHTNING_S,
    TORCHRUN,
    TORCHRUN_S,
    WORKERS,
    assert_equal_batches,
    assert_exactly_once,
    assert_resume_exact,
    fit_with_checkpoints,
    launch,
    lightning,
    read_ranks,
)
from helpers import split_ids

BUDGET, OTHER = "16000", "24000"  # about 48 and 72 of the sample's persons
RUN = ("--tokens-per-batch", BUDGET, "--masking", "dynamic", "--no-sanity")


def train_ids(root: Path) -> set[int]:
    shards, rem = split_ids(root, "train")
    return {int(i) for ids in [*shards, rem] for i in ids}


@pytest.fixture(scope="module")
def lightning_tokens(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_with_checkpoints(ds8, tmp_path_factory.mktemp("tokens") / "result.json", *RUN)


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 60)
def test_lightning_ddp_with_a_budget_trains_everyone_once_an_epoch(lightning_tokens: Path, ds8: Path) -> None:
    ranks = read_ranks(lightning_tokens)
    everyone = train_ids(ds8)  # the remainder shard's persons too: a budget leaves nobody out
    for epoch in ("0", "1"):
        per_rank = [r["train"][epoch] for r in ranks]
        assert_exactly_once(per_rank, everyone)
        assert_equal_batches(per_rank, [r["num_training_batches"] for r in ranks])
    # validation still reads batch_size persons a batch: every val person once, the same batches on every rank
    val = split_ids(ds8, "val")
    assert_equal_batches([r["val"] for r in ranks], [r["num_val_batches"][0] for r in ranks])
    assert_exactly_once([r["val"] for r in ranks], {int(i) for ids in [*val[0], val[1]] for i in ids})


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 60)
@pytest.mark.parametrize("ckpt", [f"step={CKPT_STEP}.ckpt", "end-epoch=0.ckpt"])
def test_lightning_ddp_with_a_budget_resumes_exactly(lightning_tokens: Path, ds8: Path, tmp_path: Path,
                                                     ckpt: str) -> None:
    assert_resume_exact(lightning_tokens, ds8, ckpt, tmp_path, *RUN)


@pytest.mark.slow
@pytest.mark.timeout(LIGHTNING_S + 60)
@pytest.mark.parametrize("flavour", ["lightning", "pytorch_lightning"])
def test_lightning_resumed_in_another_arrangement_and_budget_trains_the_rest_once(
        lightning_tokens: Path, ds8: Path, tmp_path: Path, flavour: str) -> None:
    """The 2-rank checkpoint at step 7, resumed on 1 rank x 1 worker at another budget: epoch 0 holds the persons
    of the first 7 steps of both old ranks and then the rest once; epoch 1 is the new arrangement's, everyone once."""
    ckpt = lightning_tokens.parent / "ckpt" / f"step={CKPT_STEP}.ckpt"
    assert int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]) == CKPT_STEP
    out = tmp_path / "resumed.json"
    run = ("--tokens-per-batch", OTHER, "--masking", "dynamic", "--no-sanity", "--flavour", flavour)
    launch([lightning(ds8, out, "--epochs", "2", "--devices", "1", "--workers", "1", "--resume", str(ckpt), *run)],
           tmp_path, LIGHTNING_S)
    before = [r["train"]["0"][:CKPT_STEP] for r in read_ranks(lightning_tokens)]
    resumed = read_ranks(out)
    assert len(resumed) == 1
    assert_exactly_once([*before, resumed[0]["train"]["0"]], train_ids(ds8))
    assert_exactly_once([resumed[0]["train"]["1"]], train_ids(ds8))
    assert len(resumed[0]["train"]["1"]) == resumed[0]["num_training_batches"]


@pytest.mark.slow
@pytest.mark.timeout(2 * TORCHRUN_S + 60)
def test_torchrun_with_a_budget_resumes_on_three_ranks(ds8: Path, tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    launch([[*TORCHRUN, "--standalone", "--nproc_per_node=2", "torchrun_reader.py", str(ds8), str(first),
             "--workers", str(WORKERS), "--epochs", "2", "--snapshot-at", "5", "--tokens-per-batch", BUDGET]],
           tmp_path / "first", TORCHRUN_S)
    ranks = read_ranks(first)
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert_exactly_once(per_rank, train_ids(ds8))
        assert_equal_batches(per_rank, [r["len"] for r in ranks])
    out = tmp_path / "resumed.json"
    launch([[*TORCHRUN, "--standalone", "--nproc_per_node=3", "torchrun_reader.py", str(ds8), str(out),
             "--workers", "1", "--epochs", "2", "--resume", str(first), "--tokens-per-batch", OTHER]],
           tmp_path / "resumed", TORCHRUN_S)
    resumed = read_ranks(out)
    assert_exactly_once([*(r["epochs"][0][:5] for r in ranks), *(r["epochs"][0] for r in resumed)], train_ids(ds8))
    rest = [len(r["epochs"][0]) for r in resumed]
    assert len(set(rest)) == 1 and 0 < rest[0] < resumed[0]["len"]  # the same rest on every rank
    assert_exactly_once([r["epochs"][1] for r in resumed], train_ids(ds8))
    assert_equal_batches([r["epochs"][1] for r in resumed], [r["len"] for r in resumed])
