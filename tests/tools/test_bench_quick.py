"""Quick benchmark check: every contender of tools/bench_loader.py runs on a tiny dataset and yields the same persons.

The expectation is built independently of the shards: the parquet source encoded directly (int64, unnarrowed),
widened to the seed's (4, 512) arrangement. Our reader, the seed's h5 pattern and every other contender must match it
person for person (keyed by person id: the reader's order is its plan's, not the file's), so the benchmark compares
loaders that deliver the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import U16, SeedRows, trained_ids

from lifeseq_shards import compat
from lifeseq_shards.convert.sources.parquet import read_vocab
from lifeseq_shards.device.batch import PackedBatch, PaddedBatch
from lifeseq_shards.device.build import padded_fields
from tools import bench_loader, common

pytestmark = [pytest.mark.bench, pytest.mark.timeout(120)]
if not compat.unsigned_tensors():  # the benchmark prepares every contender's files, LitData's among them
    pytest.skip("LitData, a contender of the loader benchmark, needs torch >= 2.3 (torch.uint16); the newest stack's "
                "suite runs this", allow_module_level=True)
PEOPLE, MANY = 700, 24
ARRANGEMENTS = {"ours-w0": (1, 0), "ours-w1": (1, 1), "ours-w2": (1, 2), "ours-2x-w0": (2, 0)}  # (ranks, workers)
SEQ = common.SEQ


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("bench")
    bench_loader.prepare(w, PEOPLE, MANY)
    return w


def seed_view(batches: list[dict[str, torch.Tensor]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Any contender's batches as the seed batch per person: (input_ids (4,512) int64, padding_mask (512,) int64)."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in batches:
        if isinstance(b, PackedBatch | PaddedBatch):  # our reader's host batches; the device pads packed ones
            b = padded_fields(b)
        if "input_ids" in b:
            assert b["input_ids"].dtype == torch.int64 and b["input_ids"].shape[1:] == (4, SEQ)
            assert torch.equal(b["original_sequence"], b["input_ids"][:, 0])
            rows = zip(b["sequence_id"].tolist(), b["input_ids"], b["padding_mask"], strict=True)
        else:
            width = b["tokens"].shape[1]
            assert width % 8 == 0 and width >= int(b["lengths"].max())
            assert b["tokens"].dtype == U16 and b["age"].dtype == torch.uint8
            ids = torch.zeros((len(b["person_id"]), 4, SEQ), dtype=torch.int64)
            for k, f in enumerate(("tokens", "abspos", "age", "segment")):
                ids[:, k, :width] = b[f].long()
            mask = (torch.arange(SEQ)[None, :] < b["lengths"].long()[:, None]).long()
            rows = zip(b["person_id"].tolist(), ids, mask, strict=True)
        for pid, ids_row, mask_row in rows:
            assert pid not in out, f"person {pid} yielded twice"
            out[pid] = (ids_row, mask_row)
    return out


def test_every_contender_yields_the_source_persons(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = SeedRows.from_parquet(work / "raw" / "sequences.parquet", read_vocab(work / "raw" / "vocab.csv"), SEQ)
    train_ids = set(bench_loader.persons(work).columns["person_id"].tolist())
    assert len(train_ids) > PEOPLE * 0.9 and train_ids <= set(expected.row)
    for name, (_, make, _) in bench_loader.CONTENDERS.items():
        if name == "ours-10k-shards":
            continue
        got = []
        for rank in range(bench_loader.processes(name)):  # the side-by-side contender: each process's half
            monkeypatch.setenv("BENCH_RANK", str(rank))
            got += list(make(work))
        if isinstance(got[0], tuple):  # the limits yield (persons, tokens) per block
            assert sum(p for p, _ in got) == len(train_ids), name
            continue
        view = seed_view(got)
        # our reader on 2 readers leaves out what the plan names (the split's persons mod 2), as training does
        left = trained_ids(work / "ours", *ARRANGEMENTS[name], 0)[1] if name in ARRANGEMENTS else set()
        assert set(view) == train_ids - left, name
        for pid, (ids, mask) in view.items():
            want = torch.from_numpy(expected.cols["input_ids"][expected.row[pid]])
            assert torch.equal(ids, want), f"{name}: person {pid} differs from the source"
            assert torch.equal(mask, (want[0] != 0).long()), f"{name}: person {pid} padding mask"


def test_reader_matches_seed_pattern_and_ships_less(work: Path) -> None:
    ours = list(bench_loader.CONTENDERS["ours-w0"][1](work))
    seed = list(bench_loader.CONTENDERS["seed-h5"][1](work))
    a, b = seed_view(ours), seed_view(seed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)
    ours_bytes = sum(bench_loader.batch_stats(x)[2] or 0 for x in ours)
    seed_bytes = sum(bench_loader.batch_stats(x)[2] or 0 for x in seed)
    assert ours_bytes < seed_bytes / 4  # narrow dtypes, no original_sequence: far fewer bytes per person


def test_side_by_side_processes_add_up(work: Path) -> None:
    """The ceiling contender's processes run at once and read disjoint halves that make up the train split."""
    row = bench_loader.run_child("ours-2x-w0", work, max_seconds=5, min_seconds=0)
    assert "error" not in row, row
    total = bench_loader.persons_total(work, "ours-2x-w0")
    assert row["complete"] and row["persons"] == total - total % 2  # the persons mod 2 left out, as training does
    assert row["persons_per_s"] > 0


def test_many_shards_first_batch(work: Path) -> None:
    row = bench_loader.measure("ours-10k-shards", work, max_seconds=5, first_only=True)
    assert row["persons"] > 0 and row["first_batch_s"] < 5


def test_bars_report_pass_and_fail() -> None:
    rows = {"ours-w0": {"disk_bytes_per_person": 40.0, "h2d_bytes_per_person": 300.0},
            "ours-w1": {"persons_per_s": 1000.0}, "ours-w2": {"persons_per_s": 1400.0},
            "seed-h5": {"persons_per_s": 100.0, "disk_bytes_per_person": 100.0, "h2d_bytes_per_person": 1000.0},
            "webdataset": {"persons_per_s": 400.0}, "zstd-limit": {"persons_per_s": 2000.0},
            "ours-10k-shards": {"first_batch_s": 0.5}}
    verdicts = [ok for _, _, _, ok in common.bars(rows)]
    # 1000/400 = 2.5 < 3; 1000/2000 = 0.5; 40/100 = 0.4; 300/1000 = 0.3 > 0.1; 0.5 s; 1400/1000 = 1.4 < 1.5
    assert verdicts == [False, True, True, False, True, False]
