"""The parquet source tokenises step-4 sequences exactly as the seed's step 5 did (checked on its own output)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import SeedRows

from lifeseq_shards.convert.sources.errors import SourceError
from lifeseq_shards.convert.sources.parquet import encode_parquet_task, parquet_tasks, read_vocab

VOCAB = (
    "TOKEN,CATEGORY,ID\n[PAD],G,0\n[CLS],G,1\n[SEP],G,2\n[MASK],G,3\n[UNK],G,4\n"
    "a,E,5\nb,E,6\nm,B,7\ny,B,8\ng,B,9\no,B,10\n"
)
BG = {"birth_month": "m", "birth_year": "y", "gender": "g", "origin": "o"}


def encode_file(path: Path, vocab: dict[str, int], **kw: object) -> dict[int, np.ndarray]:
    """person id -> (4, length) array of tokens/abspos/age/segment, over all row groups."""
    rows = SeedRows.from_parquet(path, vocab, **kw)  # type: ignore[arg-type]
    return {pid: rows.unpadded(pid) for pid in rows.row}


def test_sample_matches_seed_step5(sample: Path, nomlm_rows: SeedRows) -> None:
    """Acceptance: every person's unpadded row of encoded_nomlm.h5, and the same set of persons."""
    got = encode_file(sample / "sequences.parquet", read_vocab(sample / "vocab.csv"))
    assert sorted(got) == sorted(nomlm_rows.row)
    for pid, row in nomlm_rows.row.items():
        assert nomlm_rows.cols["padding_mask"][row, : nomlm_rows.length[row]].all()  # the real tokens lead
        np.testing.assert_array_equal(got[pid], nomlm_rows.unpadded(pid), err_msg=f"person {pid}")


def write(path: Path, rows: list[dict[str, object]], row_group_size: int | None = None) -> Path:
    schema = pa.schema(
        [
            ("RINPERSOON", pa.int64()),
            ("background", pa.struct([(k, pa.string()) for k in BG])),
            ("sentence", pa.list_(pa.list_(pa.string()))),
            ("abspos", pa.list_(pa.int64())),
            ("age", pa.list_(pa.int64())),
            ("segment", pa.list_(pa.int64())),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return path


def person(pid: int, events: list[list[str]], abspos: list[int], background: dict[str, str] | None = BG) -> dict:
    return {
        "RINPERSOON": pid,
        "background": background,
        "sentence": events,
        "abspos": abspos,
        "age": [30 + i for i in range(len(events))],
        "segment": [2] * len(events),
    }


@pytest.fixture
def vocab(tmp_path: Path) -> dict[str, int]:
    (tmp_path / "vocab.csv").write_text(VOCAB)
    return read_vocab(tmp_path / "vocab.csv")


def test_layout_unknown_tokens_and_null_background(tmp_path: Path, vocab: dict[str, int]) -> None:
    rows = [
        person(11, [["a"], ["b", "zzz"], ["a"], ["a"], ["b"]], [1, 2, 3, 4, 5]),
        person(12, [["a"]] * 5, [1, 2, 3, 4, 5], background=None),
    ]
    got = encode_file(write(tmp_path / "s.parquet", rows), vocab)
    # [CLS] origin gender month year [SEP], then each event's tokens and [SEP]; "zzz" is unknown -> [UNK] (4)
    np.testing.assert_array_equal(got[11][0], [1, 10, 9, 7, 8, 2, 5, 2, 6, 4, 2, 5, 2, 5, 2, 6, 2])
    np.testing.assert_array_equal(got[11][1], [0] * 6 + [1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5])
    np.testing.assert_array_equal(got[11][2], [0] * 6 + [30, 30, 31, 31, 31, 32, 32, 33, 33, 34, 34])
    np.testing.assert_array_equal(got[12][0, :6], [1, 4, 4, 4, 4, 2])


def test_time_range_and_minimum_events(tmp_path: Path, vocab: dict[str, int]) -> None:
    rows = [
        person(1, [["a"]] * 7, [10, 20, 30, 40, 50, 16438, 16439]),
        person(2, [["a"]] * 4, [1, 2, 3, 4]),  # too few events
        person(3, [["a"]] * 6, [1, 2, 3, 4, 5, 16439]),  # 5 left after the slice
        person(4, [["a"]] * 5, [1, 2, 3, 4, 16439]),  # 4 left after the slice: dropped
    ]
    path = write(tmp_path / "s.parquet", rows)
    got = encode_file(path, vocab)
    assert sorted(got) == [1, 3]
    assert sorted(set(got[1][1, 6:].tolist())) == [10, 20, 30, 40, 50, 16438]  # the end is inclusive
    got = encode_file(path, vocab, time_range=(25, None))
    assert sorted(got) == [1]
    assert sorted(set(got[1][1, 6:].tolist())) == [30, 40, 50, 16438, 16439]
    assert sorted(encode_file(path, vocab, time_range=(None, None))) == [1, 3, 4]


def test_keeps_most_recent_events_below_max_len(tmp_path: Path, vocab: dict[str, int]) -> None:
    # 10 events of 3 tokens + [SEP]: the prefix (6) and the last k events take 6 + 4k tokens, which must stay
    # strictly below max_seq_len (the brief's rule; the sample never reaches 512, so it cannot confirm the boundary)
    path = write(tmp_path / "s.parquet", [person(5, [["a", "b", str(i)] for i in range(10)], list(range(100, 110)))])
    for max_len, k in ((23, 4), (22, 3), (512, 10)):
        got = encode_file(path, vocab, max_seq_len=max_len)[5]
        assert got.shape[1] == 6 + 4 * k
        assert sorted(set(got[1, 6:].tolist())) == list(range(110 - k, 110))


def test_row_groups_are_tasks(tmp_path: Path, vocab: dict[str, int]) -> None:
    rows = [person(100 + i, [["a"]] * 5, [1, 2, 3, 4, 5]) for i in range(7)]
    path = write(tmp_path / "s.parquet", rows, row_group_size=3)
    assert parquet_tasks(path) == [(str(path), 0), (str(path), 1), (str(path), 2)]
    assert sorted(encode_file(path, vocab)) == list(range(100, 107))


def test_corrupt_and_incomplete_files(tmp_path: Path, vocab: dict[str, int]) -> None:
    good = write(tmp_path / "good.parquet", [person(1, [["a"]] * 5, [1, 2, 3, 4, 5])])
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(SourceError, match="cut.parquet"):
        parquet_tasks(cut)
    no_age = tmp_path / "no_age.parquet"
    pq.write_table(pq.read_table(good).drop_columns(["age"]), no_age)
    with pytest.raises(SourceError, match=r"no_age.parquet.*'age'"):
        parquet_tasks(no_age)
    bad_page = tmp_path / "bad_page.parquet"
    data = bytearray(good.read_bytes())
    data[4:200] = b"\xff" * 196  # the column chunks, not the footer
    bad_page.write_bytes(bytes(data))
    with pytest.raises(SourceError, match="bad_page.parquet: row group 0"):
        encode_parquet_task((str(bad_page), 0), vocab)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(good).slice(0, 0), empty)
    with pytest.raises(SourceError, match="empty.parquet: no rows"):
        parquet_tasks(empty)


def test_mismatched_event_columns(tmp_path: Path, vocab: dict[str, int]) -> None:
    row = person(77, [["a"]] * 5, [1, 2, 3, 4, 5])
    row["age"] = [1, 2]
    path = write(tmp_path / "s.parquet", [row])
    with pytest.raises(SourceError, match="person 77.*age"):
        encode_parquet_task(parquet_tasks(path)[0], vocab)


@pytest.mark.parametrize(
    "text, message",
    [
        ("TOKEN,ID\n[PAD],0\n", "lacks special"),
        ("TOKEN,CATEGORY\n[PAD],G\n", "lacks column"),
        (VOCAB + "c,E,5\n", "ID 5 given to both"),
        (VOCAB + "a,E,11\n", "listed twice"),
        (VOCAB + "c,E,x\n", "not an integer"),
    ],
)
def test_read_vocab_rejects(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "v.csv"
    path.write_text(text)
    with pytest.raises(SourceError, match=f"v.csv.*{message}"):
        read_vocab(path)
    with pytest.raises(SourceError, match="missing.csv"):
        read_vocab(tmp_path / "missing.csv")
