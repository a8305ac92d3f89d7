"""`shardify plan --tokens-per-batch` on the converted sample, and the split's lengths it plans from."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import SeedRows, edit_manifest, shardify

from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.manifest import ManifestError
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks


def test_split_lengths_are_the_seed_rows_lengths(nomlm_dataset: Path, nomlm_rows: SeedRows) -> None:
    m = read_manifest(nomlm_dataset)
    lengths, sizes = split_lengths(str(nomlm_dataset), m, "train")
    ids = np.concatenate([b.columns["person_id"] for e in m.splits["train"].entries()
                          for b in read_shard_blocks(nomlm_dataset / e.file, m.schema)])
    assert np.array_equal(lengths, nomlm_rows.length[[nomlm_rows.row[int(p)] for p in ids]])
    assert sizes == [e.samples for e in m.splits["train"].entries()]
    with pytest.raises(ManifestError, match="no split 'test'"):
        split_lengths(str(nomlm_dataset), m, "test")


def numbers(pattern: str, text: str) -> list[float]:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return [float(x) for x in found.groups()]


def test_plan_tokens_prints_the_new_plan_beside_the_old(nomlm_dataset: Path) -> None:
    code, out = shardify("plan", nomlm_dataset, "--tokens-per-batch", 8000, "--gpus", 4, "--workers", 2)
    assert code == 0, out
    train = read_manifest(nomlm_dataset).splits["train"]
    steps, = numbers(r"token-budget plan: (\d+) steps an epoch", out)
    lo, mean, hi = numbers(r"([\d.]+)/([\d.]+)/([\d.]+) persons a step", out)
    assert lo <= mean <= hi and abs(mean * steps - train.persons) < 0.1 * steps  # every person once
    biggest, = numbers(r"tokens a rank a step: max (\d+) <= budget 8000", out)
    assert biggest <= 8000
    balance = re.findall(r"tokens mean ([\d.]+) p99 ([\d.]+); len\^2 mean ([\d.]+) p99 ([\d.]+)", out)
    new, old = ([float(x) for x in m] for m in balance)  # tokens mean, p99, len^2 mean, p99: this plan, then today's
    assert new[0] <= 1.01 and new[1] <= 1.02 and new[0] < old[0] and new[2] < old[2]
    assert "left out: nobody" in out
    # the persons plan: 4 ranks x 2 workers = 8 slots leave out persons % 8 of the split
    assert f"left out: {train.persons % 8} persons an epoch" in out
    code, given = shardify("plan", nomlm_dataset, "--tokens-per-batch", 8000, "--gpus", 4, "--batch-size", 40)
    assert code == 0 and "persons plan (today), batch 40 persons a rank:" in given, given


def test_plan_tokens_refusals(nomlm_dataset: Path, tmp_path: Path) -> None:
    code, out = shardify("plan", nomlm_dataset, "--tokens-per-batch", 100)
    assert code == 2 and "REFUSED: tokens_per_batch=100 is under 4 x the longest person" in out, out
    code, out = shardify("plan", nomlm_dataset, "--gpus", 2)
    assert code == 2 and "needs --batch-size" in out, out
    code, out = shardify("plan", nomlm_dataset, "--tokens-per-batch", 8000, "--split", "nope")
    assert code == 2 and "no split 'nope'" in out, out
    # a lengths index that is not the one the manifest names: one line naming it, exit 2
    bad = tmp_path / "ds"
    shutil.copytree(nomlm_dataset, bad)
    index = bad / "lengths" / "train.u16"
    index.write_bytes(index.read_bytes()[:-2])
    code, out = shardify("plan", bad, "--tokens-per-batch", 8000)
    assert code == 2 and f"{index}: lengths index of 11128 bytes" in out and len(out.strip().splitlines()) == 1, out
    # without an index (converted before it), the blocks are read: one that is not the one the manifest names is
    # one line naming the shard
    edit_manifest(bad, lambda m: m["splits"]["train"].pop("lengths"))
    shard = bad / read_manifest(bad).splits["train"].shards[3].file
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # inside the first member's compressed block
    shard.write_bytes(bytes(data))
    code, out = shardify("plan", bad, "--tokens-per-batch", 8000)
    assert code == 2 and str(shard) in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize(("args", "said"), [
    (["--attention", "--batch-size", 64], "--attention deals a token budget's persons to even out len^2: it needs "
                                          "--tokens-per-batch"),
    (["--tokens-per-batch", 8000, "--split", "val"], "--tokens-per-batch plans training's batches, and --split val "
                                                     "is read as validation reads it"),
    (["--tokens-per-batch", 8000, "--batch-size", 64, "--split", "val"],
     "never by a budget; plan it with --batch-size"),
], ids=["attention-without-budget", "budget-on-val", "budget-and-batch-on-val"])
def test_plan_refuses_options_that_would_do_nothing(nomlm_dataset: Path, args: list[object], said: str) -> None:
    """Issue 40: `--attention` without a budget and `--tokens-per-batch` on the val split (validation never reads by
    budget) printed a plan as if they mattered."""
    code, out = shardify("plan", nomlm_dataset, *args)
    assert code == 2 and out.count("\n") == 1 and out.startswith("error: ") and said in out, out
