"""The converter: exact round trips of the seed's files, shard sizing, determinism; options and inputs it refuses
before any work (one line, exit 2); pool workers that die or are orphaned."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from helpers import FIELDS, SeedRows, scaled, shardify, wait_for
from small_inputs import assert_refused, hooked, write_h5, write_parquet

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset, shard_count
from lifeseq_shards.store.format import MIN_SHARD_PERSONS, token_schema
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import iter_tar_members, read_shard_blocks


def persons_of(root: Path, splits: tuple[str, ...] = ("train", "val")) -> dict[int, dict[str, np.ndarray]]:
    """Every person of the given splits (remainders included) as unpadded per-field arrays."""
    m = read_manifest(root)
    schema = m.schema
    out: dict[int, dict[str, np.ndarray]] = {}
    for split, e in m.entries():
        if split not in splits:
            continue
        for block in read_shard_blocks(root / e.file, schema):
            offs = {c: block.offsets(c) for c in ("length", "n_targets") if c in block.columns}
            for i, pid in enumerate(block.columns["person_id"].tolist()):
                assert pid not in out, f"person {pid} twice"
                rec = {}
                for f in token_schema(schema):  # the blocks read back hold the stamps once per token
                    col = block.columns[f.name]
                    if f.kind == "scalar":
                        rec[f.name] = col[i]
                    else:
                        o = offs["length" if f.kind == "ragged" else "n_targets"]
                        rec[f.name] = col[o[i] : o[i + 1]]
                out[pid] = rec
    return out


@pytest.mark.parametrize("name", ["encoded_mlm.h5", "encoded_nomlm.h5"])
def test_h5_round_trip_every_field(name: str, request: pytest.FixtureRequest) -> None:
    mlm = "_mlm" in name
    stored = persons_of(request.getfixturevalue("mlm_dataset" if mlm else "nomlm_dataset"))
    seed: SeedRows = request.getfixturevalue("mlm_rows" if mlm else "nomlm_rows")
    assert set(stored) == set(seed.row)
    fields = [k for k in seed.cols if k != "sequence_id"]
    width = seed.cols["input_ids"].shape[-1]
    rebuilt = SeedRows.from_stored(stored, width)
    for pid, row in seed.row.items():
        for k in fields:
            np.testing.assert_array_equal(rebuilt.cols[k][rebuilt.row[pid]], seed.cols[k][row],
                                          err_msg=f"{name} row {row} field {k}")


def test_narrow_dtypes_and_manifest(mlm_dataset: Path) -> None:
    m = read_manifest(mlm_dataset)
    dtypes = {f.name: f.dtype for f in m.schema}
    assert dtypes["tokens"] == "uint16" and dtypes["age"] == "uint8" and dtypes["segment"] == "uint8"
    assert dtypes["abspos"] == "int16"
    train = m.splits["train"]
    assert train.remainder is not None
    assert {s.samples for s in train.shards} == {train.shard_persons}
    total = sum(s.samples for s in train.shards) + train.remainder.samples
    assert total == train.persons
    assert train.remainder.samples < 0.02 * train.persons
    assert m.totals.persons == 5845
    for _, e in m.entries():
        assert len(e.sha256) == 64 and e.bytes == (mlm_dataset / e.file).stat().st_size


def test_shards_are_plain_tar_and_webdataset(mlm_dataset: Path) -> None:
    shard = mlm_dataset / "train" / "shard-000000.tar"
    listed = subprocess.run(["tar", "-tf", str(shard)], capture_output=True, text=True, check=True).stdout.split()
    assert listed and all(x.endswith(".block.zst") for x in listed)
    with tarfile.open(shard) as tar:
        assert [m.name for m in tar.getmembers()] == listed
    samples = list(wds.WebDataset(str(shard), shardshuffle=False))
    assert len(samples) == len(listed) and all("block.zst" in s for s in samples)


def test_bytes_per_person_at_most_half_of_gzip_h5(sample: Path, nomlm_dataset: Path) -> None:
    m = read_manifest(nomlm_dataset)
    ours = sum(e.bytes for s, e in m.entries() if s in ("train", "val"))
    assert ours <= 0.5 * (sample / "encoded_nomlm.h5").stat().st_size


def test_all_split_holds_everyone(nomlm_dataset: Path) -> None:
    assert set(persons_of(nomlm_dataset, ("all",))) == set(persons_of(nomlm_dataset))


@pytest.mark.parametrize("persons", [150, 5000, 99_999, 1_000_000, 20_000_000])
def test_default_shard_count_scales_and_keeps_remainder_small(persons: int) -> None:
    s = shard_count(persons, ConvertOptions())
    assert persons // s >= 100  # no 720 shards of 7 persons
    assert persons // s >= min(persons, MIN_SHARD_PERSONS)  # files of 4 blocks at least, where there are persons
    assert (persons % s) < 0.02 * persons
    assert s in (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040)


def test_shard_count_multiple_of_readers() -> None:
    assert shard_count(5000, ConvertOptions(nodes=2, gpus=4, workers=3)) % 24 == 0
    assert shard_count(5000, ConvertOptions(shards=7)) == 7
    assert shard_count(5000, ConvertOptions(min_shard_persons=100)) == 48  # 60 shards would hold 83 persons


def test_cli_min_shard_persons(sample: Path, tmp_path: Path) -> None:
    """Small shards on request (many readers on a small dataset); the default keeps files of >= 1,024 persons."""
    small, default = tmp_path / "small", tmp_path / "default"
    for out, extra in ((small, ["--min-shard-persons", "500"]), (default, [])):
        code, text = shardify("convert", sample / "encoded_nomlm.h5", "-o", out, *extra)
        assert code == 0, text
    sizes = {p: read_manifest(p).splits["train"].shard_persons for p in (small, default)}
    assert 500 <= sizes[small] < MIN_SHARD_PERSONS <= sizes[default]


def test_same_seed_same_dataset_and_processes_do_not_matter(sample: Path, tmp_path: Path) -> None:
    src = [str(sample / "encoded_nomlm.h5")]
    a = convert_dataset(src, tmp_path / "a", opts=ConvertOptions(progress=False, nodes=1, gpus=2, workers=2))
    b = convert_dataset(src, tmp_path / "b", opts=ConvertOptions(progress=False, nodes=1, gpus=2, workers=2,
                                                                  processes=2))
    c = convert_dataset(src, tmp_path / "c", opts=ConvertOptions(progress=False, nodes=1, gpus=2, workers=2, seed=1))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.splits["train"].shards) % 4 == 0
    val_a = set(persons_of(tmp_path / "a", ("val",)))
    assert abs(len(val_a) - 0.05 * 5845) < 4 * np.sqrt(5845 * 0.05)
    assert val_a != set(persons_of(tmp_path / "c", ("val",)))


def test_num_val_exact(sample: Path, tmp_path: Path) -> None:
    m = convert_dataset([str(sample / "encoded_nomlm.h5")], tmp_path / "d",
                        opts=ConvertOptions(progress=False, num_val=500))
    assert m.splits["val"].persons == 500
    assert m.splits["train"].persons == 5845 - 500


def test_persons_are_shuffled_across_shards(nomlm_dataset: Path, nomlm_rows: SeedRows) -> None:
    input_order = nomlm_rows.row
    m = read_manifest(nomlm_dataset)
    first = next(read_shard_blocks(nomlm_dataset / m.splits["train"].shards[0].file, m.schema))
    rows = np.array([input_order[p] for p in first.columns["person_id"].tolist()])
    assert rows.max() - rows.min() > 0.8 * 5845  # drawn from all over the input, not one contiguous run


def test_manifest_is_last_and_json(mlm_dataset: Path) -> None:
    m = json.loads((mlm_dataset / "manifest.json").read_text())
    assert m["params"]["input_kind"] == "hdf5" and m["fingerprint"]
    assert not list(mlm_dataset.glob("**/*.tmp")) and not (mlm_dataset / ".tmp").exists()


def test_parquet_conversion_equals_seed_encoding(sample: Path, nomlm_rows: SeedRows, tmp_path: Path) -> None:
    """The acceptance test: step-4 parquet + vocab through `convert` == the seed's own step-5 output."""
    convert_dataset([str(sample / "sequences.parquet")], tmp_path / "pq", vocab=str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, processes=2))
    ours = persons_of(tmp_path / "pq")
    assert set(ours) == set(nomlm_rows.row)
    for pid, row in nomlm_rows.row.items():
        rec = ours[pid]
        assert int(rec["length"]) == nomlm_rows.length[row]
        for j, name in enumerate(FIELDS):
            np.testing.assert_array_equal(rec[name], nomlm_rows.unpadded(pid)[j], err_msg=f"person {pid} {name}")


def test_tar_members_read_like_tarfile_and_pax_is_refused(nomlm_dataset: Path, tmp_path: Path) -> None:
    """The reader's own ustar parser yields what tarfile yields for our shards, across short reads (a pipe or a
    socket), and refuses an extended header it would otherwise misread."""
    shard = nomlm_dataset / "train" / "shard-000001.tar"
    with tarfile.open(shard) as tar:
        want = [(i.name, tar.extractfile(i).read()) for i in tar if i.isfile()]  # type: ignore[union-attr]

    class Trickle(io.BytesIO):
        def read(self, n: int = -1) -> bytes:
            return super().read(min(n, 100) if n > 0 else n)

    assert list(iter_tar_members(Trickle(shard.read_bytes()))) == want
    pax = tmp_path / "pax.tar"
    with tarfile.open(pax, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("ä" * 120)  # a long non-ASCII name needs a pax header
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with open(pax, "rb") as fh, pytest.raises(OSError, match="extended header 'x' not supported"):
        list(iter_tar_members(fh))


def test_convert_says_what_the_filter_drops(sample: Path, nomlm_rows: SeedRows, tmp_path: Path) -> None:
    """The seed's filter (fewer than 5 events in the time range) drops the sample's rows that its own step-5 file
    lacks: 6,000 parquet rows, 5,845 in encoded_nomlm.h5. They were dropped without a word; inspect showed only
    "input rows"."""
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(sample / "sequences.parquet").metadata.num_rows
    lost = rows - len(nomlm_rows.row)
    assert lost > 0
    code, out = shardify("convert", sample / "sequences.parquet", "--vocab", sample / "vocab.csv", "-o",
                         tmp_path / "pq")
    assert code == 0, out
    said = f"dropped {lost:,} of {rows:,} input rows: {lost:,} with fewer than 5 events in the time range"
    assert out.strip().splitlines()[-1] == f"{tmp_path / 'pq'}: {said}"
    assert read_manifest(tmp_path / "pq").totals.dropped == {"too_few_events": lost}
    code, out = shardify("inspect", tmp_path / "pq")
    assert code == 0 and f"dropped      {said.removeprefix('dropped ')}; too_few_events {lost:,}" in out
    # an encoded .h5 is the seed's output already: nothing is dropped, and convert says that too
    code, out = shardify("convert", sample / "encoded_nomlm.h5", "-o", tmp_path / "h5")
    assert out.strip().splitlines()[-1].endswith(f"dropped none of {len(nomlm_rows.row):,} input rows")


# -- options and inputs refused before any work: one line, exit 2 ---------------------------------------------
def test_duplicate_id_across_files_names_both(tmp_path: Path) -> None:
    a, b = write_h5(tmp_path / "a.h5"), write_h5(tmp_path / "b.h5", sequence_id=np.array([7, 8, 9, 101]))
    assert_refused(*shardify("convert", a, b, "-o", tmp_path / "out"),
                   f"{a}: row 1: person id 101 occurs 2 times (also {b}: row 3)")


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
def test_convert_option_refused(args: list[str], part: str, small_vocab: Path, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet")
    assert_refused(*shardify("convert", path, "--vocab", small_vocab, "-o", tmp_path / "out", *args), part)
    assert not (tmp_path / "out").exists()


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


# -- pool workers (slow: real subprocess conversions) -------------------------------------------------------------
# each pool worker reports its pid and then works for two minutes
STALL = """
def stalled(args):
    (report / str(os.getpid())).touch()
    time.sleep(120)
e._encode_and_narrow = stalled
"""


# the pool worker that encodes the second input dies as an out-of-memory kill would end it
DIE_IN_WORKER = """
real = e._encode_and_narrow
def dying(args):
    if args[1][0].endswith("1.h5"):
        os._exit(9)
    return real(args)
e._encode_and_narrow = dying
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pool_worker_that_dies_is_one_line(tmp_path: Path) -> None:
    """A pool worker killed mid-conversion (the OOM killer) ends the conversion with one line and exit 2, not a
    BrokenProcessPool traceback, and leaves no dataset."""
    inputs = [write_h5(tmp_path / f"{i}.h5", sequence_id=np.arange(4) + 10 * i) for i in range(3)]
    proc = hooked(DIE_IN_WORKER, tmp_path / "report", "convert", *inputs, "-o", tmp_path / "ds", "--processes", 2)
    _, err = proc.communicate(timeout=scaled(60))
    assert_refused(proc.returncode, err.decode(), f"{tmp_path / 'ds'}: a conversion process died", "--processes")
    assert not (tmp_path / "ds").exists()  # it made the directory: a failed conversion removes it, lock and all


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
        proc.wait(scaled(10))
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

    monkeypatch.setattr(passes, "encode_pass", encoded)
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
