"""The parquet source tokenises step-4 sequences exactly as the seed's step 5 did (checked on its own output), and
refuses in one line, naming file, row and column, a parquet file or vocab.csv it cannot store exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import SeedRows, shardify
from small_inputs import BG, SMALL_VOCAB, N, assert_refused, person_ids, write_h5, write_parquet

from lifeseq_shards.convert.sources.errors import SourceError
from lifeseq_shards.convert.sources.parquet import (
    encode_parquet_task,
    parquet_tasks,
    read_vocab,
    survey_parquet_task,
)
from lifeseq_shards.store.format import STAMPS, Block, Field

VOCAB = (
    "TOKEN,CATEGORY,ID\n[PAD],G,0\n[CLS],G,1\n[SEP],G,2\n[MASK],G,3\n[UNK],G,4\n"
    "a,E,5\nb,E,6\nm,B,7\ny,B,8\ng,B,9\no,B,10\n"
)


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


@pytest.mark.parametrize("max_seq_len", [512, 40])
def test_survey_and_a_selection_are_the_encodes_own(sample: Path, max_seq_len: int) -> None:
    """An array task's two views of a row group of the sample (lengths cut by --max-seq-len too): the survey gives
    the full encode's ids, lengths, rows and drop reasons without tokens; an encode with a selection gives exactly
    the full encode's block of those persons (their tokens and stamps, in file order), and nobody else's."""
    vocab = read_vocab(sample / "vocab.csv")
    task = parquet_tasks(sample / "sequences.parquet")[0]
    full = encode_parquet_task(task, vocab, max_seq_len)
    survey = survey_parquet_task(task, max_seq_len)
    assert sorted(survey.columns) == ["drop_reason", "every_id", "length", "person_id", "row"]
    for name, col in survey.columns.items():
        np.testing.assert_array_equal(col, full.columns[name], err_msg=name)
    assert (full.columns["drop_reason"] != 0).any() and full.n > 10  # both kinds of row are there
    at = np.arange(1, full.n, 3)  # every third kept person
    chosen = encode_parquet_task(task, vocab, max_seq_len, select=np.sort(full.columns["person_id"][at]))
    schema = [Field("person_id", "int64", "scalar"), Field("length", "int64", "scalar"),
              *(Field(c, "int64", "ragged") for c in ("tokens", *STAMPS))]
    want = full.take(at, schema)
    assert isinstance(chosen, Block) and chosen.n == len(at)
    for f in schema:
        np.testing.assert_array_equal(chosen.columns[f.name], want.columns[f.name], err_msg=f.name)


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


# -- input the converter cannot store exactly, or does not read: one line naming file, row, column -------------
def strings(values: list[bytes]) -> pa.Array:
    """A string array that may hold bytes that are not UTF-8 (parquet stores them; pyarrow's builders refuse)."""
    return pa.array(values, pa.binary()).cast(pa.string(), safe=False)


def nested(inner: pa.Array, per_event: int = 1, events: int = 5) -> pa.Array:
    """Each person: ``events`` events of ``per_event`` tokens, tokens taken from ``inner`` in order."""
    tok = pa.ListArray.from_arrays(pa.array(range(0, len(inner) + 1, per_event), pa.int32()), inner)
    return pa.ListArray.from_arrays(pa.array(range(0, len(tok) + 1, events), pa.int32()), tok)


NOT_UTF8 = strings([b"a"] * 5 + [b"a", b"a\xff", b"a", b"a", b"a"] + [b"a"] * 5)

PARQUET_CASES = {
    "id missing (null)": ({"RINPERSOON": pa.array([100.0, None, 102.0])}, ["row 1", "no person id"]),
    "id NaN (pandas)": ({"RINPERSOON": pa.array([100.0, np.nan, 102.0], from_pandas=False)},
                        ["row 1", "RINPERSOON", "nan"]),
    "id with a fraction": ({"RINPERSOON": pa.array([100.0, 101.5, 102.0])}, ["row 1", "RINPERSOON", "101.5"]),
    "id beyond 2^53 as float": ({"RINPERSOON": pa.array([100.0, 2.0**60, 102.0])}, ["row 1", "RINPERSOON"]),
    "uint64 id >= 2^63": ({"RINPERSOON": pa.array([100, 2**63, 102], pa.uint64())},
                          ["row 1", "RINPERSOON", str(2**63)]),
    "ids as strings": ({"RINPERSOON": pa.array(["100", "x", "102"])}, ["column 'RINPERSOON' is string"]),
    "float abspos": ({"abspos": pa.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 100.7], [1, 2, 3, 4, 5]])},
                     ["row 1", "person 101", "abspos", "100.7"]),
    "token not UTF-8": ({"sentence": nested(NOT_UTF8)}, ["row 1", "person 101", "sentence", "not UTF-8"]),
    "tokens as bytes": ({"sentence": nested(pa.array([b"a"] * 15, pa.binary()))},
                        ["binary>>, expected list<list<string>>"]),
    "background not UTF-8": ({"background": pa.StructArray.from_arrays(
        [strings([b"m", b"m", b"\xfe"]), *[pa.array(["y"] * 3)] * 3], names=list(BG))},
        ["row 2", "background.birth_month", "not UTF-8"]),
    "background lacks a field": ({"background": pa.array([{**{k: v for k, v in BG.items() if k != "gender"},
                                                            "sex": "g"}] * N)},
                                 ["column 'background'", "gender"]),
    "sentence a flat string": ({"sentence": pa.array(["a a a a a"] * N)}, ["column 'sentence' is string"]),
    "sentence of integers": ({"sentence": pa.array([[[5]] * 5] * N)}, ["int64>>, expected list<list<string>>"]),
    "duplicate id": ({"RINPERSOON": pa.array([100, 101, 100])}, ["row 0: person id 100 occurs 2 times", "row 2"]),
    # the copy in row 2 has too few events to be kept: which copy survived was the filter's silent choice
    "duplicate id, one copy filtered out": ({"RINPERSOON": pa.array([100, 101, 100]), **{
        c: pa.array([[1, 2, 3, 4, 5]] * 2 + [[1, 2, 3]]) for c in ("abspos", "age", "segment")},
        "sentence": pa.array([[["a"]] * 5] * 2 + [[["a"]] * 3])}, ["row 0: person id 100 occurs 2 times", "row 2"]),
}


@pytest.mark.parametrize("case", PARQUET_CASES)
def test_parquet_input_refused(case: str, small_vocab: Path, tmp_path: Path) -> None:
    columns, parts = PARQUET_CASES[case]
    path = write_parquet(tmp_path / "in.parquet", **columns)
    code, out = shardify("convert", path, "--vocab", small_vocab, "-o", tmp_path / "out", "--val-fraction", 0)
    assert_refused(code, out, str(path), *parts)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_integral_float_ids_are_kept_exactly(small_vocab: Path, tmp_path: Path) -> None:
    """pandas makes an id column float: integral values below 2^53 are stored as the integers they are."""
    path = write_parquet(tmp_path / "in.parquet", RINPERSOON=pa.array([100.0, 2.0**52 + 1, 102.0]))
    code, out = shardify("convert", path, "--vocab", small_vocab, "-o", tmp_path / "out", "--val-fraction", 0)
    assert code == 0, out
    assert person_ids(tmp_path / "out") == [100, 102, 2**52 + 1]


@pytest.mark.parametrize("text, parts", [
    (SMALL_VOCAB.encode() + b"b\xe9,E,10\n", ["line 12", "not UTF-8"]),
    (SMALL_VOCAB.encode() + b"b,E,4294967296\n", ["line 12", "ID 4294967296"]),
    # the masker, the padding and the seed's step 5 take [PAD] [CLS] [SEP] [MASK] [UNK] to be ids 0-4
    (SMALL_VOCAB.replace("[SEP],G,2", "[SEP],G,12").replace("a,E,5", "a,E,2").encode(), ["line 4", "[SEP] has ID 12",
                                                                                     "IDs 0-4"]),
    (b"TOKEN,CATEGORY,ID\n" + b"".join(b"%s,G,%d\n" % (s, i + 1) for i, s in enumerate(
        [b"[PAD]", b"[CLS]", b"[SEP]", b"[MASK]", b"[UNK]", b"a", b"m", b"y", b"g", b"o"])), ["[PAD] has ID 1"]),
])
def test_vocab_refused(text: bytes, parts: list[str], tmp_path: Path) -> None:
    (tmp_path / "v.csv").write_bytes(text)
    path = write_parquet(tmp_path / "in.parquet")
    assert_refused(*shardify("convert", path, "--vocab", tmp_path / "v.csv", "-o", tmp_path / "out"),
                   str(tmp_path / "v.csv"), *parts)


def test_a_data_file_passed_as_vocab_is_named_as_such(tmp_path: Path) -> None:
    """The sequences (or an encoded .h5) given to --vocab by mistake: "not a vocabulary CSV", not "not UTF-8"."""
    path = write_parquet(tmp_path / "in.parquet")
    for wrong, kind in ((path, "Parquet"), (write_h5(tmp_path / "in.h5"), "HDF5")):
        assert_refused(*shardify("convert", path, "--vocab", wrong, "-o", tmp_path / "out"),
                       f"{wrong}: not a vocabulary CSV (a {kind} file)")
