"""The synthetic population: deterministic, step-4 shaped, with the length distribution it promises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from lifeseq_shards.convert.sources.parquet import encode_parquet_task, parquet_tasks, read_vocab
from lifeseq_shards.convert.sources.synth import synth_population

PEOPLE, GROUP = 6000, 2500


@pytest.fixture(scope="module")
def population(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    synth_population(out, PEOPLE, seed=3, rows_per_group=GROUP, progress=False)
    return out


def test_same_seed_same_bytes_other_seed_differs(population: Path, tmp_path: Path) -> None:
    synth_population(tmp_path / "again", PEOPLE, seed=3, rows_per_group=GROUP, progress=False)
    for name in ("sequences.parquet", "vocab.csv"):
        assert (tmp_path / "again" / name).read_bytes() == (population / name).read_bytes()
    synth_population(tmp_path / "other", 100, seed=4, rows_per_group=GROUP, progress=False)
    other = pq.read_table(tmp_path / "other" / "sequences.parquet")
    first = pq.read_table(population / "sequences.parquet").slice(0, 100)
    assert other.column("RINPERSOON") != first.column("RINPERSOON")
    assert other.column("abspos") != first.column("abspos")
    assert not list((tmp_path / "again").glob("*.tmp"))


def test_schema_row_groups_and_ids(population: Path, sample: Path) -> None:
    pf = pq.ParquetFile(population / "sequences.parquet")
    assert pf.schema_arrow.remove_metadata() == pq.read_schema(sample / "sequences.parquet").remove_metadata()
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    assert sizes == [2500, 2500, 1000]  # one generated group per row group: memory is bounded by rows_per_group
    ids = pf.read(columns=["RINPERSOON"]).column(0).to_numpy()
    assert len(np.unique(ids)) == PEOPLE and ids.min() >= 0
    assert not np.all(np.diff(ids) > 0)  # not simply counting up


def test_events_are_plausible(population: Path) -> None:
    t = pq.read_table(population / "sequences.parquet")
    vocab = read_vocab(population / "vocab.csv")
    assert [vocab[s] for s in ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")] == [0, 1, 2, 3, 4]
    assert {"month_1", "month_12", "year_1940", "year_2020", "gender_1", "gender_2", "gender_MISSING"} <= set(vocab)
    assert 2000 <= len(vocab) <= 10000
    abspos = t.column("abspos").to_pylist()
    segment = t.column("segment").to_pylist()
    sentence = t.column("sentence").to_pylist()
    assert all(a == sorted(a) for a in abspos)
    flat = np.concatenate([np.asarray(a) for a in abspos if a])
    assert flat.min() >= 0 and 0.02 < (flat > 16438).mean() < 0.3
    for a, s in zip(abspos, segment, strict=True):
        assert s == [1 if i and a[i] == a[i - 1] else 2 for i in range(len(a))]
    sizes = {len(ev) for events in sentence for ev in events}
    assert sizes <= set(range(1, 7)) and len(sizes) >= 4
    tokens = [tok for events in sentence for ev in events for tok in ev]
    assert 0 < sum(tok not in vocab for tok in tokens) / len(tokens) < 0.01
    assert 0 < t.column("background").null_count < PEOPLE * 0.02


def test_length_distribution_after_tokenising(population: Path) -> None:
    vocab = read_vocab(population / "vocab.csv")
    blocks = [encode_parquet_task(task, vocab) for task in parquet_tasks(population / "sequences.parquet")]
    length = np.concatenate([b.columns["length"] for b in blocks])
    dropped = 1 - len(length) / PEOPLE
    capped = (length >= 512 - 7).mean()  # within one event (<= 6 tokens + [SEP]) of the cap
    assert 0.01 < dropped < 0.06, dropped
    assert 0.10 < capped < 0.22, capped
    assert length.max() < 512 and 100 < np.median(length) < 300
    age = np.concatenate([b.columns["age"] for b in blocks])
    assert 0 <= age.min() and age.max() < 100
