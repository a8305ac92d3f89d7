"""The balance benchmark, quick: its synthetic lengths are those `shardify synth` + convert make, its shards those
the converter cuts for each arrangement, and it writes its tables and plot (naming its commit, checked against what each
rank's reader receives) with the token-budget plan ahead of the persons plan."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest
from tools import bench_balance
from tools.common import commit

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]  # the bench reads every arrangement with real readers


def test_synth_lengths_are_those_synth_and_convert_make(tmp_path: Path) -> None:
    synth_population(tmp_path / "pop", 4000, seed=0, progress=False)
    convert_dataset([str(tmp_path / "pop" / "sequences.parquet")], tmp_path / "ds", str(tmp_path / "pop" / "vocab.csv"),
                    opts=ConvertOptions(progress=False))
    m = read_manifest(tmp_path / "ds")
    real = np.concatenate([split_lengths(str(tmp_path / "ds"), m, split)[0] for split in m.splits])
    model = bench_balance.synth_lengths(4000, seed=0)
    assert abs(len(model) - len(real)) <= 0.02 * len(real)  # the same persons drop for too few events, about
    assert model.max() == real.max() == 511  # the cap: the converter keeps fewer tokens than 512
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(np.quantile(model, q) - np.quantile(real, q)) <= 0.08 * np.quantile(real, q), q


def test_arrangement_shards_are_those_the_converter_cuts(sample: Path, tmp_path: Path) -> None:
    """The shards the bench plans on are the ones `shardify convert --gpus R --workers W` writes, persons in the same
    order whatever the arrangement; and the reader's batches per message are the bench's."""
    default = bench_balance.train_lengths(bench_balance.convert_sample(sample, tmp_path / "d", ConvertOptions()))[0]
    for ranks, workers in ((8, 2), (4, 0)):
        root = bench_balance.convert_sample(sample, tmp_path / f"{ranks}x{workers}",
                                            bench_balance.arrangement_options(ranks, workers))
        lengths, sizes = bench_balance.train_lengths(root)
        assert sizes == bench_balance.arrangement_shards(len(lengths), ranks, workers)
        assert np.array_equal(lengths, default)
        budget = int(round(50 * lengths.mean()))
        ds = ShardedDataset(root, split="train", world=World(0, ranks), num_workers=workers, packed=True,
                            tokens_per_batch=budget)
        ShardedLoader(ds)  # attaches: the dataset then knows the loader's batches per message
        assert ds.batches_per_message == bench_balance.per_message(lengths, budget, workers)


def test_bench_writes_its_tables_with_the_new_plan_ahead(tmp_path: Path, sample: Path) -> None:
    bench_balance.main(["--out", str(tmp_path), "--sample", str(sample), "--synth", "20000", "--epochs", "1"])
    with (tmp_path / "balance.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["population"] for r in rows} == {"sample", "synth-20k"}
    m = read_manifest(bench_balance.convert_sample(sample, tmp_path / "ds", ConvertOptions()))
    assert {r["persons"] for r in rows if r["population"] == "sample"} == {str(m.splits["train"].persons)}
    assert len(rows) == 2 * len(bench_balance.RANKS) * len(bench_balance.PERSONS) * len(bench_balance.WORKERS) * 3
    by = {(r["population"], r["ranks"], r["workers"], r["batch_persons"], r["plan"]): r for r in rows}
    assert {k[2] for k in by} == {"0", "2"}
    for (pop, ranks, workers, persons, plan), row in by.items():
        old = by[(pop, ranks, workers, persons, "persons")]
        if plan == "tokens":
            assert float(row["tokens_mean"]) < float(old["tokens_mean"]) and float(row["tokens_mean"]) <= 1.01
            assert float(row["len2_mean"]) < float(old["len2_mean"])
        if plan == "attention":  # len^2 evened out, tokens within one longest person a rank
            assert float(row["len2_mean"]) < float(old["len2_mean"]) and float(row["len2_mean"]) <= 1.02
            assert int(row["max_rank_tokens"]) <= int(row["budget"])
    text = (tmp_path / "balance.md").read_text()
    assert "## Method" in text and "| synth-20k | " in text and "balance.png" in text
    assert f"at commit {commit()}" in text and "every rank received exactly the tokens of the plan's batch" in text
    assert "## The token plan at 8 ranks x 50 persons" in text
    assert (tmp_path / "balance.png").read_bytes()[:4] == b"\x89PNG"
