"""`shardify verify` catches damage; bad input gets one line, exit 2, and no finished-looking directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import copy_of, edit_manifest, read_all, scaled, serve_directory, shardify, to_format2

from lifeseq_shards.convert.passes import ConvertError, ConvertOptions, convert_dataset
from lifeseq_shards.store.format import Block, decode_member
from lifeseq_shards.store.manifest import parse_manifest
from lifeseq_shards.store.shardfile import iter_tar_members, write_shard


@pytest.fixture
def copy(mlm_dataset: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    shutil.copytree(mlm_dataset, dst)
    return dst


def test_verify_clean_dataset(mlm_dataset: Path) -> None:
    code, out = shardify("verify", str(mlm_dataset))
    assert code == 0 and "OK" in out


def test_verify_flipped_byte(copy: Path) -> None:
    shard = copy / "train" / "shard-000003.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # inside the first member's compressed data
    shard.write_bytes(bytes(data))
    code, out = shardify("verify", str(copy))
    assert code == 1
    assert "train/shard-000003.tar: sha256 differs" in out
    assert "train/shard-000003.tar: 000000.block.zst: cannot decode" in out


def test_verify_runs_that_miss_their_tokens(copy: Path) -> None:
    """A block whose runs move a token from one person to the next decodes (the totals still match) but is wrong."""
    schema = parse_manifest((copy / "manifest.json").read_bytes()).schema
    shard = copy / "train" / "shard-000002.tar"
    with open(shard, "rb") as fh:
        blocks = [decode_member(data, schema) for _, data in iter_tar_members(fh)]
    c = {k: v.copy() for k, v in blocks[0].columns.items()}
    last_of_first = int(c["n_runs"][0]) - 1
    c["run_length"][last_of_first] += 1
    c["run_length"][last_of_first + 1] -= 1
    blocks[0] = Block(c)
    write_shard(shard, blocks, schema)
    code, out = shardify("verify", str(copy))
    assert code == 1
    assert f"person {int(c['person_id'][0])} (record 0) has runs that do not add up to its length" in out


def test_verify_truncated_shard(copy: Path) -> None:
    shard = copy / "val" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    code, out = shardify("verify", str(copy))
    assert code == 1 and "val/shard-000001.tar" in out and "bytes, manifest says" in out


def test_verify_deleted_shard(copy: Path) -> None:
    (copy / "train" / "shard-000010.tar").unlink()
    code, out = shardify("verify", str(copy))
    assert code == 1 and "train/shard-000010.tar: missing" in out


def test_verify_edited_manifest(copy: Path) -> None:
    m = json.loads((copy / "manifest.json").read_text())
    m["splits"]["train"]["shards"][5]["samples"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    code, out = shardify("verify", str(copy))
    assert code == 1 and "train/shard-000005.tar: 115 persons decoded, manifest says 116" in out


def test_verify_swapped_shards_changes_fingerprint(copy: Path) -> None:
    m = json.loads((copy / "manifest.json").read_text())
    m["fingerprint"] = "0" * 32
    (copy / "manifest.json").write_text(json.dumps(m))
    code, out = shardify("verify", str(copy))
    assert code == 1 and "fingerprint" in out


def test_inspect_reports_totals(mlm_dataset: Path) -> None:
    code, out = shardify("inspect", str(mlm_dataset))
    assert code == 0 and "persons      5,845 converted" in out and "fingerprint" in out


@pytest.mark.parametrize("root", ["http://127.0.0.1:9/ds", "pipe:curl -s http://127.0.0.1:9/ds/{}"])
def test_verify_refuses_a_remote_root_naming_it(root: str) -> None:
    """verify hashes files on the local disk: a remote root was reported as 'no manifest (not a converted dataset,
    or its conversion did not finish)' under a mangled name (http:/...), as if the dataset were broken."""
    code, out = shardify("verify", root)
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert root in out and "local" in out and "no manifest" not in out


@pytest.mark.timeout(60)
def test_inspect_names_a_remote_root_as_given(mlm_dataset: Path) -> None:
    with serve_directory(mlm_dataset) as url:
        code, out = shardify("inspect", url)
    assert code == 0 and f"dataset      {url}\n" in out and "persons      5,845 converted" in out


# -- bad input ------------------------------------------------------------------------------------------------


def assert_refused(args: list[str], needle: str, out_dir: Path) -> None:
    code, out = shardify("convert", *args, "-o", str(out_dir))
    assert code == 2, out
    lines = [x for x in out.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], out
    assert not (out_dir / "manifest.json").exists()


def test_missing_input(tmp_path: Path) -> None:
    assert_refused([str(tmp_path / "nope.h5")], "nope.h5: no such file", tmp_path / "o")


def test_truncated_h5(sample: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.h5"
    bad.write_bytes((sample / "encoded_nomlm.h5").read_bytes()[:1_000_000])
    assert_refused([str(bad)], "cut.h5", tmp_path / "o")


def test_h5_missing_dataset(tmp_path: Path) -> None:
    bad = tmp_path / "x.h5"
    with h5py.File(bad, "w") as h:
        h["input_ids"] = np.zeros((3, 4, 8), dtype=np.int64)
    assert_refused([str(bad)], "missing dataset(s) padding_mask, original_sequence, sequence_id", tmp_path / "o")


def _tiny_h5(path: Path, n: int = 4, abspos: int = 10) -> None:
    ids = np.zeros((n, 4, 8), dtype=np.int64)
    ids[:, 0, :3] = [1, 7, 2]
    ids[:, 1, :3] = abspos
    with h5py.File(path, "w") as h:
        h["input_ids"] = ids
        h["padding_mask"] = (np.arange(8) < 3).astype(np.int64)[None].repeat(n, 0)
        h["original_sequence"] = ids[:, 0]
        h["sequence_id"] = np.arange(100, 100 + n)


def test_value_that_does_not_fit(tmp_path: Path) -> None:
    bad = tmp_path / "big.h5"
    _tiny_h5(bad, abspos=40_000)
    assert_refused([str(bad)], "field 'abspos' value 40000 does not fit int16", tmp_path / "o")
    code, out = shardify("convert", bad, "-o", tmp_path / "wide", "--dtype", "abspos=int32", "--val-fraction", 0)
    assert code == 0, out


def test_empty_input(tmp_path: Path) -> None:
    empty = tmp_path / "empty.h5"
    with h5py.File(empty, "w") as h:
        for k in ("padding_mask", "original_sequence"):
            h[k] = np.zeros((0, 8), dtype=np.int64)
        h["input_ids"] = np.zeros((0, 4, 8), dtype=np.int64)
        h["sequence_id"] = np.zeros(0, dtype=np.int64)
    assert_refused([str(empty)], "empty.h5: no rows", tmp_path / "o")


def test_duplicate_person(tmp_path: Path) -> None:
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    _tiny_h5(a)
    _tiny_h5(b)
    assert_refused([str(a), str(b)], "person id 100 occurs 2 times", tmp_path / "o")


def test_refuses_existing_dataset_unless_overwrite(mlm_dataset: Path, sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(mlm_dataset, out)
    before = (out / "manifest.json").read_text()
    code, text = shardify("convert", str(sample / "encoded_nomlm.h5"), "-o", str(out))
    assert code == 2 and "already holds a dataset" in text and (out / "manifest.json").read_text() == before
    code, text = shardify("convert", str(sample / "encoded_nomlm.h5"), "-o", str(out), "--overwrite")
    assert code == 0 and (out / "manifest.json").read_text() != before


def test_parquet_needs_vocab(sample: Path, tmp_path: Path) -> None:
    assert_refused([str(sample / "sequences.parquet")], "needs --vocab", tmp_path / "o")


def test_killed_half_way_leaves_no_dataset_and_rerun_works(sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    code = (
        "import os, lifeseq_shards.convert.writers as w\n"
        "real = w.write_shard\n"
        "n = [0]\n"
        "def dying(*a, **k):\n"
        "    n[0] += 1\n"
        "    if n[0] == 5: os._exit(9)\n"
        "    return real(*a, **k)\n"
        "w.write_shard = dying\n"
        "from lifeseq_shards.cli import main\n"
        f"main(['convert', {str(sample / 'encoded_nomlm.h5')!r}, '-o', {str(out)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=scaled(120))
    assert proc.returncode == 9
    assert out.exists() and not (out / "manifest.json").exists()
    assert shardify("verify", str(out))[0] == 2  # not a dataset
    m = convert_dataset([str(sample / "encoded_nomlm.h5")], out, opts=ConvertOptions(progress=False))
    assert shardify("verify", str(out))[0] == 0 and m.totals.persons == 5845


def test_library_error_type(tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="unknown input kind"):
        convert_dataset([str(tmp_path / "x.csv")], tmp_path / "o")


def test_truncated_parquet(sample: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cut.parquet"
    bad.write_bytes((sample / "sequences.parquet").read_bytes()[:500_000])
    assert_refused([str(bad), "--vocab", str(sample / "vocab.csv")], "cut.parquet: not a readable parquet file",
                   tmp_path / "o")


def test_parquet_missing_column(sample: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    bad = tmp_path / "nosentence.parquet"
    pq.write_table(pq.read_table(sample / "sequences.parquet").drop_columns(["sentence"]), bad)
    assert_refused([str(bad), "--vocab", str(sample / "vocab.csv")], "missing column 'sentence'", tmp_path / "o")


def test_parquet_empty(sample: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(sample / "sequences.parquet").slice(0, 0), empty)
    assert_refused([str(empty), "--vocab", str(sample / "vocab.csv")], "empty.parquet: no rows", tmp_path / "o")


def test_everyone_filtered_out_is_an_error(sample: Path, tmp_path: Path) -> None:
    assert_refused([str(sample / "sequences.parquet"), "--vocab", str(sample / "vocab.csv"), "--time-range-end", "0"],
                   "no person left to convert", tmp_path / "o")


def test_refuses_a_foreign_non_empty_directory(sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "home"
    (out / "train").mkdir(parents=True)
    (out / "train" / "notes.txt").write_text("mine")
    assert_refused([str(sample / "encoded_nomlm.h5")], "is not empty and is not a dataset", out)
    assert (out / "train" / "notes.txt").read_text() == "mine"


def test_inspect_says_how_many_training_leaves_out(sample: Path, tmp_path: Path) -> None:
    """Converted for 4 GPUs x 2 workers: training reads the remainder too and leaves out train persons mod 8 (it
    said 'training skips it' of the remainder, and nothing of the persons left out)."""
    code, out = shardify("convert", sample / "encoded_nomlm.h5", "-o", tmp_path / "ds", "--gpus", 4, "--workers", 2)
    assert code == 0, out
    train = json.loads((tmp_path / "ds" / "manifest.json").read_text())["splits"]["train"]["persons"]
    code, out = shardify("inspect", tmp_path / "ds")
    assert code == 0 and "training skips" not in out
    assert f"left out     of each training epoch: train persons mod (ranks x workers), others each epoch: " \
           f"{train % 8} at the 8 readers converted for" in out


# -- verify and upgrade check what the reader relies on ---------------------------------------------------------------
def test_format2_datasets_still_read_once_upgraded(nomlm_copy: Path, nomlm_dataset: Path) -> None:
    """`shardify upgrade` adds the blocks' checksums that the reader requires (tests/store/test_block_checks.py)."""
    edit_manifest(nomlm_copy, to_format2)
    assert shardify("upgrade", str(nomlm_copy))[0] == 0
    got, want = read_all(nomlm_copy), read_all(nomlm_dataset)
    assert len(got) == len(want) and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want, strict=True))


def test_verify_names_a_shard_path_that_is_a_directory(nomlm_copy: Path) -> None:
    """Before: a traceback (IsADirectoryError) from verify."""
    edit_manifest(nomlm_copy, lambda m: m["splits"]["train"]["shards"][0].update(file="val"))
    code, out = shardify("verify", str(nomlm_copy))
    assert code == 1 and "val: missing (a directory)" in out, out
    with pytest.raises(IsADirectoryError, match=r"Is a directory: .*/val"):
        read_all(nomlm_copy)


@pytest.mark.parametrize("block_persons", [8, 32])
def test_verify_checks_block_persons(blocks16: Path, tmp_path: Path, block_persons: int) -> None:
    """Before: verify said OK, and reading failed on a short block (or with an IndexError deep in numpy)."""
    ds = copy_of(blocks16, tmp_path)
    edit_manifest(ds, lambda m: m.update(block_persons=block_persons))
    code, out = shardify("verify", str(ds))
    needle = f"000000.block.zst: 16 persons, where the manifest's 115 persons in blocks of {block_persons}"
    assert code == 1 and needle in out, out
    with pytest.raises(OSError, match="persons, where the manifest's 115 persons"):
        read_all(ds)


def test_inspect_plot_draws_the_lengths_into_a_file(nomlm_dataset: Path, tmp_path: Path) -> None:
    """`shardify inspect --plot FILE`: the summary as before, and the length histogram as a picture."""
    import matplotlib.image

    code, out = shardify("inspect", nomlm_dataset, "--plot", tmp_path / "lengths.png")
    assert code == 0 and out.startswith(shardify("inspect", nomlm_dataset)[1]), out
    assert f"drawn in {tmp_path / 'lengths.png'}" in out
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(tmp_path / "lengths.png").shape[:2] == (400, 800)
    code, out = shardify("inspect", nomlm_dataset, "--plot", tmp_path / "lengths.nope")
    assert code == 2 and out.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'lengths.nope'}: "), out
