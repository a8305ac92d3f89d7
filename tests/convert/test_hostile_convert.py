"""The converter as a hostile user meets it (issue 12): input it cannot store exactly is refused with one line naming
file, row and column (exit 2, no traceback); options out of range are refused before any work; `--overwrite` removes
only what the old manifest lists and keeps the old dataset until the new one is complete; a second conversion into
the same directory is refused; a killed conversion leaves no pool worker behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import shard_ids, shardify, wait_for

from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks

VOCAB = "TOKEN,CATEGORY,ID\n[PAD],G,0\n[CLS],G,1\n[SEP],G,2\n[MASK],G,3\n[UNK],G,4\na,E,5\nm,B,6\ny,B,7\ng,B,8\no,B,9\n"
BG = {"birth_month": "m", "birth_year": "y", "gender": "g", "origin": "o"}
BG_TYPE = pa.struct([(k, pa.string()) for k in BG])
N = 3  # persons of the small inputs, ids 100, 101, 102


def assert_refused(code: int, out: str, *parts: str) -> None:
    """Exit 2, no traceback, and the last line (after any progress bar) the one error line, holding every part."""
    lines = out.strip().splitlines()
    assert code == 2 and "Traceback" not in out and lines[-1].startswith("error: "), out
    assert sum(line.startswith("error: ") for line in lines) == 1, out
    for part in parts:
        assert part in lines[-1], (part, out)


def strings(values: list[bytes]) -> pa.Array:
    """A string array that may hold bytes that are not UTF-8 (parquet stores them; pyarrow's builders refuse)."""
    return pa.array(values, pa.binary()).cast(pa.string(), safe=False)


def nested(inner: pa.Array, per_event: int = 1, events: int = 5) -> pa.Array:
    """Each person: ``events`` events of ``per_event`` tokens, tokens taken from ``inner`` in order."""
    tok = pa.ListArray.from_arrays(pa.array(range(0, len(inner) + 1, per_event), pa.int32()), inner)
    return pa.ListArray.from_arrays(pa.array(range(0, len(tok) + 1, events), pa.int32()), tok)


def write_parquet(path: Path, **columns: Any) -> Path:
    """N persons of 5 one-token events each; ``columns`` replace any column (as arrow arrays or python lists)."""
    cols: dict[str, Any] = {
        "RINPERSOON": pa.array(range(100, 100 + N), pa.int64()),
        "background": pa.array([BG] * N, BG_TYPE),
        "sentence": pa.array([[["a"]] * 5] * N, pa.list_(pa.list_(pa.string()))),
        **{c: pa.array([[1, 2, 3, 4, 5]] * N, pa.list_(pa.int64())) for c in ("abspos", "age", "segment")},
    }
    cols.update(columns)
    pq.write_table(pa.table(cols), path)
    return path


def write_h5(path: Path, n: int = 4, width: int = 8, **override: np.ndarray) -> Path:
    """``n`` rows of 3 tokens ([CLS] a [SEP]), ids 100..; ``override`` replaces whole datasets."""
    ids = np.zeros((n, 4, width), dtype=np.int64)
    ids[:, 0, :3] = [1, 5, 2]
    ids[:, 1, 1:3] = 10
    data = {"input_ids": ids, "padding_mask": (np.arange(width) < 3).astype(np.int64)[None].repeat(n, 0),
            "original_sequence": ids[:, 0], "sequence_id": np.arange(100, 100 + n), **override}
    with h5py.File(path, "w") as h:
        for k, v in data.items():
            h[k] = v
    return path


@pytest.fixture
def vocab(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.csv"
    path.write_text(VOCAB)
    return path


def person_ids(root: Path) -> list[int]:
    return sorted(int(p) for _, e in read_manifest(root).entries() for p in shard_ids(root / e.file))


# ---------------------------------------------------------------------------------------------------------------
# 1 + 4: input that cannot be stored exactly, or is not what the converter reads: one line naming file, row, column

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
def test_parquet_input_refused(case: str, vocab: Path, tmp_path: Path) -> None:
    columns, parts = PARQUET_CASES[case]
    path = write_parquet(tmp_path / "in.parquet", **columns)
    code, out = shardify("convert", path, "--vocab", vocab, "-o", tmp_path / "out", "--val-fraction", 0)
    assert_refused(code, out, str(path), *parts)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_integral_float_ids_are_kept_exactly(vocab: Path, tmp_path: Path) -> None:
    """pandas makes an id column float: integral values below 2^53 are stored as the integers they are."""
    path = write_parquet(tmp_path / "in.parquet", RINPERSOON=pa.array([100.0, 2.0**52 + 1, 102.0]))
    code, out = shardify("convert", path, "--vocab", vocab, "-o", tmp_path / "out", "--val-fraction", 0)
    assert code == 0, out
    assert person_ids(tmp_path / "out") == [100, 102, 2**52 + 1]


H5_CASES: dict[str, tuple[dict[str, np.ndarray], list[str]]] = {
    "id NaN": ({"sequence_id": np.array([100, np.nan, 102, 103])}, ["row 1", "sequence_id", "nan"]),
    "uint64 id >= 2^63": ({"sequence_id": np.array([100, 2**63, 102, 103], np.uint64)}, ["row 1", str(2**63)]),
    "float abspos": ({"input_ids": np.where(np.arange(4)[:, None, None] == 2, 100.7, 0) + np.zeros((4, 4, 8))},
                     ["row 2", "input_ids", "100.7"]),
    "row without tokens": ({"padding_mask": (np.arange(8) < 3) * (np.arange(4) != 2)[:, None]},
                           ["row 2", "person 102", "no tokens"]),
    "input_ids of 2 dims": ({"input_ids": np.zeros((4, 8), np.int64)}, ["input_ids has shape (4, 8)"]),
    "padding_mask of another width": ({"padding_mask": np.ones((4, 6), np.int64)}, ["padding_mask has shape (4, 6)"]),
    "fewer input_ids rows than ids": ({"sequence_id": np.arange(100, 105)}, ["sequence_id has shape (5,)"]),
    "ids as strings": ({"sequence_id": np.array([b"a", b"b", b"c", b"d"])}, ["sequence_id holds |S1"]),
}


@pytest.mark.parametrize("case", H5_CASES)
def test_h5_input_refused(case: str, tmp_path: Path) -> None:
    override, parts = H5_CASES[case]
    path = write_h5(tmp_path / "in.h5", **override)
    code, out = shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0)
    assert_refused(code, out, str(path), *parts)


def mlm_targets(n: int = 4, width: int = 10, **at: tuple[int, int]) -> dict[str, np.ndarray]:
    """The seed's offline-MLM datasets for ``write_h5`` rows of 3 tokens: no target in any row but the rows named
    ``rowR=(position, true token)``, each with that one target."""
    slots = int(0.3 * width)
    pos, tok = np.full((n, width), -1), np.full((n, width), -1)
    pos[:, :slots], tok[:, :slots] = width - 1, 0
    for key, (p, t) in at.items():
        pos[int(key[3:]), 0], tok[int(key[3:]), 0] = p, t
    return {"target_pos": pos, "target_tokens": tok, "target_cls": np.zeros(n, np.int64)}


def test_mlm_targets_helper_converts(tmp_path: Path) -> None:
    """The offline-MLM rows the refusals below start from are accepted (a target inside the sequence)."""
    path = write_h5(tmp_path / "in.h5", width=10, **mlm_targets(row1=(1, 5)))
    code, out = shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0)
    assert code == 0, out
    assert shardify("verify", tmp_path / "out")[0] == 0


def test_mlm_target_past_the_sequence_refused(tmp_path: Path) -> None:
    """A target position at or past the row's real tokens (what verify refuses) is refused by the converter, not
    written into a dataset that `verify` then calls broken."""
    path = write_h5(tmp_path / "in.h5", width=10, **mlm_targets(row2=(7, 5)))
    assert_refused(*shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0),
                   str(path), "row 2", "person 102", "target_pos 7", "3 tokens")
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("dataset, override", [
    ("original_sequence", {}),
    ("input_ids", {"row2": (1, 5)}),  # the masked ids (row 0 of input_ids) of an offline-MLM file
    ("target_tokens", {"row2": (1, 50)}),
])
def test_h5_token_outside_the_vocabulary_refused(dataset: str, override: dict[str, tuple[int, int]], vocab: Path,
                                                  tmp_path: Path) -> None:
    """With --vocab the manifest records its size, which the masker and the model's embedding take as the bound of
    every token id: an id at or beyond it is refused (it used to convert, and only `verify` found it)."""
    ids = np.zeros((4, 4, 10), dtype=np.int64)
    ids[:, 0, :3] = [1, 5, 2]
    orig = ids[:, 0].copy()
    if dataset == "original_sequence":
        orig[2, 1] = ids[2, 0, 1] = 50
    if dataset == "input_ids":
        ids[2, 0, 1] = 50
    mlm = mlm_targets(**override) if override else {}
    path = write_h5(tmp_path / "in.h5", width=10, input_ids=ids, original_sequence=orig, **mlm)
    assert_refused(*shardify("convert", path, "--vocab", vocab, "-o", tmp_path / "out", "--val-fraction", 0),
                   str(path), "row 2", "person 102", dataset, "token id 50", "vocabulary of 10")
    code, out = shardify("convert", path, "-o", tmp_path / "no-vocab", "--val-fraction", 0)  # no bound to check
    assert code == 0, out


def test_duplicate_id_across_files_names_both(tmp_path: Path) -> None:
    a, b = write_h5(tmp_path / "a.h5"), write_h5(tmp_path / "b.h5", sequence_id=np.array([7, 8, 9, 101]))
    assert_refused(*shardify("convert", a, b, "-o", tmp_path / "out"),
                   f"{a}: row 1: person id 101 occurs 2 times (also {b}: row 3)")


@pytest.mark.parametrize("text, parts", [
    (VOCAB.encode() + b"b\xe9,E,10\n", ["line 12", "not UTF-8"]),
    (VOCAB.encode() + b"b,E,4294967296\n", ["line 12", "ID 4294967296"]),
    # the masker, the padding and the seed's step 5 take [PAD] [CLS] [SEP] [MASK] [UNK] to be ids 0-4
    (VOCAB.replace("[SEP],G,2", "[SEP],G,12").replace("a,E,5", "a,E,2").encode(), ["line 4", "[SEP] has ID 12",
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


OPTION_CASES = [
    (["--num-val", "-5"], "--num-val"),
    (["--max-seq-len", "5"], "--max-seq-len 5"),
    (["--shards", "-3"], "--shards"),
    (["--block-persons", "0"], "--block-persons"),
    (["--val-fraction", "1"], "--val-fraction"),
    (["--val-fraction", "-0.1"], "--val-fraction"),
    (["--zstd-level", "99"], "--zstd-level"),
    (["--processes", "0"], "--processes"),
    (["--dtype", "abspos=float32"], "--dtype abspos=float32: not an integer dtype"),
    (["--dtype", "abspos=bogus"], "--dtype abspos=bogus: not an integer dtype"),
    (["--dtype", "lenght=int32"], "--dtype lenght=int32: no field 'lenght'"),
    # both asked for and they disagree: --shards used to win silently, and training then left persons out
    (["--shards", "3", "--gpus", "2"], "--shards 3 does not divide into 1 x 2 x 1 = 2 readers"),
]


@pytest.mark.parametrize("args, part", OPTION_CASES, ids=[" ".join(a) for a, _ in OPTION_CASES])
def test_convert_option_refused(args: list[str], part: str, vocab: Path, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet")
    assert_refused(*shardify("convert", path, "--vocab", vocab, "-o", tmp_path / "out", *args), part)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--gpus", "0"], ["--gpus", "-1"], ["--batch-size", "0"], ["--nodes", "0"]])
def test_plan_option_refused(args: list[str], mlm_dataset: Path) -> None:
    assert_refused(*shardify("plan", mlm_dataset, "--batch-size", "8", *args), args[0])


@pytest.mark.parametrize("args, part", [
    (["--shards", "4"], "--shards 4 is more than the 2 persons of split val"),
    (["--gpus", "2", "--workers", "2"], "4 readers (nodes x gpus x workers) is more than the 2 persons of split val"),
])
def test_too_few_persons_for_the_shards_names_the_split(args: list[str], part: str, tmp_path: Path) -> None:
    """The split that cannot be cut is named, with what to change (it said "of a split": train or val?)."""
    path = write_h5(tmp_path / "in.h5", n=40)
    assert_refused(*shardify("convert", path, "-o", tmp_path / "out", "--num-val", 2, *args), part, "--num-val")


@pytest.mark.parametrize("args, part", [
    (["--num-val", "4"], "--num-val 4 leaves no training persons (4 in all)"),
    (["--val-fraction", "0.999"], "--val-fraction 0.999 leaves no training persons (4 in all)"),
])
def test_a_split_that_leaves_no_training_persons_is_refused(args: list[str], part: str, tmp_path: Path) -> None:
    """Both ways of sizing val refuse to leave train empty (--val-fraction wrote a dataset without a train split)."""
    assert_refused(*shardify("convert", write_h5(tmp_path / "in.h5"), "-o", tmp_path / "out", *args), part)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("args", [["--max-seq-len", "256"], ["--time-range-start", "100"],
                                  ["--time-range-end", "5"]], ids=" ".join)
def test_parquet_only_options_refused_for_h5(args: list[str], tmp_path: Path) -> None:
    """An encoded .h5 keeps its width and its events: an option that would cut them is refused, not ignored."""
    path = write_h5(tmp_path / "in.h5")
    assert_refused(*shardify("convert", path, "-o", tmp_path / "out", *args), str(path), args[0], "parquet input only")
    assert not (tmp_path / "out").exists()


def test_dtype_length_int32_holds_long_sequences(tmp_path: Path) -> None:
    """The error for a sequence over 65,535 tokens says `--dtype length=int32`; that option is honoured (every count
    and position in a sequence widens with it) and the long sequence comes back whole."""
    width = 70_000
    ids = np.zeros((2, 4, width), dtype=np.int64)
    ids[:, 0] = 5
    ids[:, 1] = np.arange(width) // 3  # runs of 3 tokens
    path = write_h5(tmp_path / "long.h5", n=2, width=width, input_ids=ids, original_sequence=ids[:, 0],
                    padding_mask=np.ones((2, width), np.int64))
    assert_refused(*shardify("convert", path, "-o", tmp_path / "narrow", "--dtype", "abspos=int32"),
                   "field 'length' value 70000 does not fit uint16", "--dtype length=int32")
    code, out = shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0, "--dtype", "length=int32",
                    "--dtype", "abspos=int32")
    assert code == 0, out
    m = read_manifest(tmp_path / "out")
    dtypes = {f.name: f.dtype for f in m.schema}
    assert dtypes["length"] == dtypes["n_runs"] == dtypes["run_length"] == "int32"
    assert shardify("verify", tmp_path / "out")[0] == 0
    blocks = [b for _, e in m.entries() for b in read_shard_blocks(tmp_path / "out" / e.file, m.schema)]
    assert [int(x) for b in blocks for x in b.columns["length"]] == [width, width]
    np.testing.assert_array_equal(blocks[0].columns["abspos"][:width], ids[0, 1])


# ---------------------------------------------------------------------------------------------------------------
# 2: --overwrite replaces exactly the old dataset's files, and only once the new dataset is complete


def listed(root: Path) -> set[str]:
    return {e.file for _, e in read_manifest(root).entries()}


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """40 persons (ids 100..139) in 4 train and 4 val shards, beside a user's own files."""
    out = tmp_path / "ds"
    code, text = shardify("convert", write_h5(tmp_path / "old.h5", n=40), "-o", out, "--num-val", 4, "--shards", 4)
    assert code == 0, text
    for own in ("all/embeddings.npy", "train/notes.txt", "README.txt"):
        (out / own).parent.mkdir(exist_ok=True)
        (out / own).write_text("mine")
    return out


def test_overwrite_removes_only_the_old_datasets_files(dataset: Path, tmp_path: Path) -> None:
    old = listed(dataset)
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite")
    assert code == 0, text
    for own in ("all/embeddings.npy", "train/notes.txt", "README.txt"):
        assert (dataset / own).read_text() == "mine"
    new = listed(dataset)
    assert not [f for f in old - new if (dataset / f).exists()]  # train/shard-000002.tar and the like are gone
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert {p.name for p in dataset.iterdir()} == {"manifest.json", "train", "val", "all", "README.txt",
                                                   ".conversion.lock"}


def test_failed_overwrite_keeps_the_old_dataset(dataset: Path, tmp_path: Path) -> None:
    before = (dataset / "manifest.json").read_text()
    bad = write_h5(tmp_path / "dup.h5", sequence_id=np.array([1, 2, 1, 3]))
    assert_refused(*shardify("convert", bad, "-o", dataset, "--overwrite"), "person id 1 occurs 2 times")
    assert (dataset / "manifest.json").read_text() == before
    assert shardify("verify", dataset)[0] == 0 and person_ids(dataset) == list(range(100, 140))
    assert not (dataset / ".conversion-staging").exists()


def _file_entry(path: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        m = json.loads(text)
        m["splits"]["train"]["shards"][0]["file"] = path
        return json.dumps(m)
    return edit


MANIFEST_EDITS = {
    "../victim.txt": (_file_entry("../victim.txt"), "'../victim.txt', outside the dataset's own files"),
    "absolute path": (lambda t: t.replace('"train/shard-000000.tar"', '"/victim.txt"'), "'/victim.txt', outside"),
    "not JSON": (lambda t: t[: len(t) // 2], "manifest.json: cannot tell which files it lists"),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_overwrite_refuses_a_manifest_it_cannot_trust(edit: str, dataset: Path, tmp_path: Path) -> None:
    """--overwrite deletes what the old manifest lists: never a path that leaves the dataset, nothing when unsure."""
    change, message = MANIFEST_EDITS[edit]
    (dataset / "manifest.json").write_text(change((dataset / "manifest.json").read_text()))
    assert_refused(*shardify("convert", write_h5(tmp_path / "new.h5"), "-o", dataset, "--overwrite"), message)
    assert (dataset / "train" / "shard-000000.tar").exists() and (dataset / "manifest.json").exists()


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory on another filesystem than tmp_path: /dev/shm where it is a tmpfs of its own."""
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="lifeseq-scratch-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_overwrite_with_a_split_directory_on_another_filesystem(dataset: Path, scratch: Path, tmp_path: Path) -> None:
    """train/ a symlink to scratch space: the old shards were deleted, then the rename failed (EXDEV, exit 1), no
    manifest left, and every rerun failed the same way."""
    shutil.move(dataset / "train", scratch / "train")
    (dataset / "train").symlink_to(scratch / "train")
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite")
    assert code == 0, text
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert (dataset / "train").is_symlink() and (dataset / "train/notes.txt").read_text() == "mine"
    assert {p.name for p in scratch.rglob("*")} == {"train", "notes.txt"} | {
        Path(f).name for f in listed(dataset) if f.startswith("train/")}  # no staging copies, no old shards
    assert not (dataset / ".conversion-staging").exists()


def test_overwrite_that_cannot_copy_onto_the_other_filesystem_keeps_the_old_dataset(
        dataset: Path, scratch: Path, tmp_path: Path) -> None:
    shutil.move(dataset / "train", scratch / "train")
    (dataset / "train").symlink_to(scratch / "train")
    before = (dataset / "manifest.json").read_text()
    (scratch / "train" / ".conversion-staging").write_text("a file where the copies go")  # the copy fails
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    assert_refused(*shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite"),
                   "cannot copy the new shard onto its filesystem", "the old dataset is kept")
    assert (dataset / "manifest.json").read_text() == before
    assert shardify("verify", dataset)[0] == 0 and person_ids(dataset) == list(range(100, 140))


def test_a_lock_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    """Before: an IsADirectoryError traceback, exit 1."""
    (tmp_path / "ds" / ".conversion.lock").mkdir(parents=True)
    assert_refused(*shardify("convert", write_h5(tmp_path / "a.h5"), "-o", tmp_path / "ds"),
                   ".conversion.lock: cannot open the conversion lock")


# ---------------------------------------------------------------------------------------------------------------
# 2 + 3: processes (slow: real subprocess conversions)

# Runs `shardify ARGS...` with a hook in the converter: argv[1] is a directory the hook reports into.
HOOKED = """
import os, sys, time
from pathlib import Path
import lifeseq_shards.convert.passes as c

report = Path(sys.argv[1])
{hook}
from lifeseq_shards.cli import main
main(sys.argv[2:])
"""
# the first pass waits for report/go: the conversion holds its directory meanwhile
HOLD = """
real = c._pass1
def held(*a, **k):
    (report / "started").touch()
    while not (report / "go").exists():
        time.sleep(0.05)
    return real(*a, **k)
c._pass1 = held
"""
# each pool worker reports its pid and then works for two minutes
STALL = """
def stalled(args):
    (report / str(os.getpid())).touch()
    time.sleep(120)
c._encode_and_narrow = stalled
"""


def hooked(hook: str, report: Path, *args: object) -> subprocess.Popen[bytes]:
    report.mkdir()
    return subprocess.Popen([sys.executable, "-c", HOOKED.format(hook=hook), str(report), *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_second_conversion_into_the_same_directory_is_refused(overwrite: list[str], tmp_path: Path) -> None:
    out, report = tmp_path / "ds", tmp_path / "report"
    first = hooked(HOLD, report, "convert", write_h5(tmp_path / "a.h5"), "-o", out)
    try:
        assert wait_for(lambda: (report / "started").exists(), 60), first.stderr
        assert_refused(*shardify("convert", write_h5(tmp_path / "b.h5", n=5), "-o", out, *overwrite),
                       f"{out}: another conversion is writing to it")
        (report / "go").touch()
        assert first.wait(60) == 0, first.stderr.read()  # type: ignore[union-attr]
    finally:
        first.kill()
    assert shardify("verify", out)[0] == 0 and person_ids(out) == [100, 101, 102, 103]


# dies while moving the new shards in (the old files are gone, one new shard is in place)
DIE_REPLACING = """
real = os.replace
def dying(src, dst):
    if ".conversion-staging" in str(src) and str(src).endswith("shard-000001.tar"):
        os._exit(9)
    return real(src, dst)
os.replace = dying
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_while_replacing_leaves_no_dataset_and_rerun_clears_only_ours(dataset: Path, tmp_path: Path) -> None:
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    proc = hooked(DIE_REPLACING, tmp_path / "report", "convert", new_input, "-o", dataset, "--num-val", 2,
                  "--shards", 2, "--overwrite")
    assert proc.wait(60) == 9, proc.stderr.read()  # type: ignore[union-attr]
    assert not (dataset / "manifest.json").exists() and shardify("verify", dataset)[0] == 2
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2)  # no --overwrite needed
    assert code == 0, text
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert {str(p.relative_to(dataset)) for p in dataset.rglob("*") if p.is_file()} == listed(dataset) | {
        "manifest.json", ".conversion.lock", "all/embeddings.npy", "train/notes.txt", "README.txt"}


# the pool worker that encodes the second input dies as an out-of-memory kill would end it
DIE_IN_WORKER = """
real = c._encode_and_narrow
def dying(args):
    if args[1][0].endswith("1.h5"):
        os._exit(9)
    return real(args)
c._encode_and_narrow = dying
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_worker_that_dies_is_one_line(tmp_path: Path) -> None:
    """A pool worker killed mid-conversion (the OOM killer) ends the conversion with one line and exit 2, not a
    BrokenProcessPool traceback, and leaves no dataset."""
    inputs = [write_h5(tmp_path / f"{i}.h5", sequence_id=np.arange(4) + 10 * i) for i in range(3)]
    proc = hooked(DIE_IN_WORKER, tmp_path / "report", "convert", *inputs, "-o", tmp_path / "ds", "--processes", 2)
    _, err = proc.communicate(timeout=60)
    assert_refused(proc.returncode, err.decode(), f"{tmp_path / 'ds'}: a conversion process died", "--processes")
    assert {p.name for p in (tmp_path / "ds").iterdir()} == {".conversion.lock"}


def state(pid: int) -> str | None:
    """The process's state letter (Z: exited, not yet reaped by its new parent), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_conversion_leaves_no_pool_worker(tmp_path: Path) -> None:
    """SIGKILL of `convert --processes 2` mid-way: both pool workers end with it (they used to run on, orphaned)."""
    report = tmp_path / "report"
    inputs = [write_h5(tmp_path / f"{i}.h5", sequence_id=np.arange(4) + 10 * i) for i in range(4)]
    proc = hooked(STALL, report, "convert", *inputs, "-o", tmp_path / "ds", "--processes", 2)
    workers: list[int] = []
    try:
        assert wait_for(lambda: len(list(report.iterdir())) >= 2, 60), proc.stderr
        workers = [int(p.name) for p in report.iterdir()]
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: all(state(w) in (None, "Z") for w in workers), 10), [state(w) for w in workers]
    finally:
        proc.kill()
        for w in workers:
            if state(w) not in (None, "Z"):
                os.kill(w, signal.SIGKILL)


def test_num_val_over_the_input_rows_is_refused_before_encoding(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The input's row count is known from its metadata: a --num-val that leaves no training persons is refused
    before the first pass encodes anything (it took 54 s at 1 M rows), and no output directory is left behind."""
    from lifeseq_shards.convert import passes

    def encoded(*args: object, **kw: object) -> None:
        raise AssertionError("the first pass ran")

    monkeypatch.setattr(passes, "_pass1", encoded)
    assert_refused(*shardify("convert", write_h5(tmp_path / "in.h5", n=40), "-o", tmp_path / "out", "--num-val", 40),
                   "--num-val 40 leaves no training persons (40 in all)")
    assert not (tmp_path / "out").exists()


def test_a_failed_conversion_removes_the_directory_it_created_only(tmp_path: Path) -> None:
    """A refusal found while converting (the val fraction takes everyone) leaves no empty directory that looks like
    a dataset; a directory that was there before (empty: the converter refuses any other) stays."""
    path = write_h5(tmp_path / "in.h5")
    assert_refused(*shardify("convert", path, "-o", tmp_path / "new" / "out", "--val-fraction", "0.999"),
                   "leaves no training persons")
    assert not (tmp_path / "new" / "out").exists()
    (tmp_path / "old").mkdir()
    assert_refused(*shardify("convert", path, "-o", tmp_path / "old", "--val-fraction", "0.999"),
                   "leaves no training persons")
    assert (tmp_path / "old").is_dir()
