"""The lengths index (store/lengths.py): every person's length of a split in one small file the manifest lists with
its size, count and sha256. Read instead of the blocks when listed, the same lengths in the same order; a damaged or
missing index refused in one line naming it, locally and over http(s) and `pipe:`; the fingerprint blind to it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import edit_manifest, serve_directory

from lifeseq_shards.store.format import make_schema
from lifeseq_shards.store.lengths import index_dtype, index_lengths, split_lengths, write_lengths_index
from lifeseq_shards.store.manifest import ManifestError, fingerprint, parse_manifest
from lifeseq_shards.store.remote import read_manifest

TRAIN = "lengths/train.u16"


def test_the_index_holds_the_lengths_the_blocks_hold(nomlm_dataset: Path) -> None:
    """Every split (train, val, all) lists its index, and the index gives what decoding every block gives."""
    m = read_manifest(nomlm_dataset)
    assert set(m.splits) == {"train", "val", "all"}
    for name, split in m.splits.items():
        assert split.lengths is not None and split.lengths.file == f"lengths/{name}.u16"
        assert split.lengths.dtype == "uint16" and split.lengths.persons == split.persons
        assert (nomlm_dataset / split.lengths.file).stat().st_size == split.lengths.bytes == 2 * split.persons
        indexed, sizes = split_lengths(str(nomlm_dataset), m, name)
        decoded, decoded_sizes = split_lengths(str(nomlm_dataset), m, name, index=False)
        assert indexed.dtype == decoded.dtype == np.int64
        assert np.array_equal(indexed, decoded) and sizes == decoded_sizes
        assert sizes == [e.samples for e in split.entries()]


def test_the_fingerprint_does_not_cover_the_index(nomlm_dataset: Path) -> None:
    """The fingerprint is the one the schema and the shards make, with or without the index: a checkpoint saved on
    the dataset converted before the index (tests/reader/test_pinned_batches.py pins one) still resumes on it."""
    raw = json.loads((nomlm_dataset / "manifest.json").read_text())
    m = read_manifest(nomlm_dataset)
    assert m.fingerprint == fingerprint(m.schema, [e.sha256 for _, e in m.entries()]) and m.fingerprint_matches
    for info in raw["splits"].values():
        del info["lengths"]
    bare = parse_manifest(json.dumps(raw))
    assert bare.fingerprint == m.fingerprint and bare.fingerprint_matches
    assert all(s.lengths is None for s in bare.splits.values())


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


@pytest.mark.parametrize(("damage", "needle"), [
    (flip, "lengths index's sha256 differs from the manifest's"),
    (truncate, "lengths index of 11128 bytes, the manifest lists 11130"),
    (Path.unlink, "cannot read the lengths index (No such file or directory)"),
])
def test_a_damaged_index_is_refused_naming_it(nomlm_copy: Path, damage: Any, needle: str) -> None:
    damage(nomlm_copy / TRAIN)
    m = read_manifest(nomlm_copy)
    with pytest.raises(ManifestError) as err:
        split_lengths(str(nomlm_copy), m, "train")
    assert str(err.value).startswith(f"{nomlm_copy}/{TRAIN}: ") and needle in str(err.value)
    assert "\n" not in str(err.value)
    assert len(split_lengths(str(nomlm_copy), m, "train", index=False)[0]) == m.splits["train"].persons


def test_over_http_and_pipe(nomlm_dataset: Path, tmp_path: Path) -> None:
    """The index is read through the same I/O edge as the shards; a missing one over HTTP names its URL."""
    want, sizes = split_lengths(str(nomlm_dataset), read_manifest(nomlm_dataset), "train")
    with serve_directory(nomlm_dataset) as url:
        m = read_manifest(url)
        got, got_sizes = split_lengths(url, m, "train")
        assert np.array_equal(got, want) and got_sizes == sizes
    pipe = f"pipe:cat {nomlm_dataset}/{{}}"
    assert np.array_equal(split_lengths(pipe, read_manifest(pipe), "train")[0], want)
    shutil.copytree(nomlm_dataset, tmp_path / "ds")
    (tmp_path / "ds" / TRAIN).unlink()
    with serve_directory(tmp_path / "ds") as url, pytest.raises(ManifestError) as err:
        split_lengths(url, read_manifest(url), "train")
    assert str(err.value) == (f"{url}{TRAIN}: cannot read the lengths index (curl exited with status 22: an HTTP "
                              "error status)")


@pytest.mark.parametrize(("change", "needle"), [
    (lambda m: m["splits"]["train"]["lengths"].update(bytes=7), "splits.train.lengths.bytes is 7, 5565 persons of "
                                                                "uint16 make 11130"),
    (lambda m: m["splits"]["train"]["lengths"].update(dtype="int8"), "splits.train.lengths.dtype is 'int8', not one"),
    (lambda m: m["splits"]["train"]["lengths"].update(file="../x.u16"), "splits.train.lengths.file '../x.u16' is not"),
    (lambda m: m["splits"]["val"]["lengths"].update(file=TRAIN), f"splits.val.lengths.file '{TRAIN}' is listed twice"),
    (lambda m: m["splits"]["train"]["lengths"].pop("sha256"), "missing key 'sha256' in splits.train.lengths"),
])
def test_an_index_entry_that_cannot_be_is_one_line(nomlm_copy: Path, change: Any, needle: str) -> None:
    edit_manifest(nomlm_copy, change)
    with pytest.raises(ManifestError) as err:
        read_manifest(nomlm_copy)
    assert str(err.value).startswith(f"{nomlm_copy}/manifest.json: ") and needle in str(err.value)


@pytest.mark.parametrize(("length", "dtype"), [("uint16", "uint16"), ("int16", "uint16"), ("int32", "uint32"),
                                               ("uint32", "uint32"), ("int64", "uint64")])
def test_the_index_dtype_holds_every_length_the_schema_can(tmp_path: Path, length: str, dtype: str) -> None:
    schema = make_schema("uint16", {"length": length})
    assert index_dtype(schema) == dtype
    lengths = np.array([1, np.iinfo(length).max, 7], dtype=length)
    index = write_lengths_index(tmp_path, "train", lengths, schema)
    suffix = {"uint16": 16, "uint32": 32, "uint64": 64}[dtype]
    assert index.file == f"lengths/train.u{suffix}" and index.dtype == dtype and index.persons == 3
    data = (tmp_path / index.file).read_bytes()
    assert len(data) == index.bytes == 3 * np.dtype(dtype).itemsize
    assert data[:2] == b"\x01\x00"  # little-endian on any machine
    assert np.array_equal(index_lengths(data, index, 3), lengths)
    with pytest.raises(ValueError, match="the lengths index lists 3 persons, the split's shards 4"):
        index_lengths(data, index, 4)
    assert [p.name for p in (tmp_path / "lengths").iterdir()] == [f"train.u{suffix}"]  # no temp file left
