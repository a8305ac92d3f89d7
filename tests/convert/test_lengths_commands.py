"""The lengths index in the commands: `verify` holds it against the blocks, `upgrade` adds it to a dataset converted
before it (the shards and the fingerprint untouched, a second run changing nothing), `inspect` says where it is,
`convert --overwrite` replaces it with the dataset."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from helpers import edit_manifest, shardify

from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks

TRAIN = "lengths/train.u16"


def test_verify_finds_an_index_that_disagrees_with_the_blocks(nomlm_copy: Path) -> None:
    """An index with a wrong length whose sha256 the manifest was made to match: sound as a file, wrong as data."""
    m = read_manifest(nomlm_copy)
    lengths = np.fromfile(nomlm_copy / TRAIN, dtype="<u2")
    lengths[[200, 300]] += 1
    lengths.tofile(nomlm_copy / TRAIN)
    sha = hashlib.sha256((nomlm_copy / TRAIN).read_bytes()).hexdigest()
    edit_manifest(nomlm_copy, lambda j: j["splits"]["train"]["lengths"].update(sha256=sha))
    second = m.splits["train"].shards[1]  # person 200 is the second shard's 85th (115 a shard)
    pid = next(read_shard_blocks(nomlm_copy / second.file, m.schema)).columns["person_id"][85]
    code, out = shardify("verify", nomlm_copy)
    assert code == 1, out
    line = (f"{TRAIN}: person 200 of the split (id {pid}, {second.file} record 85) has length {lengths[200]} in the "
            f"index, {lengths[200] - 1} in its block")
    assert line in out.splitlines()
    assert out.count(f"{TRAIN}:") == 1  # the first wrong person, not every one after it


def test_verify_names_a_damaged_or_missing_index(nomlm_copy: Path) -> None:
    (nomlm_copy / TRAIN).write_bytes(b"\0\0" + (nomlm_copy / TRAIN).read_bytes()[2:])
    (nomlm_copy / "lengths/val.u16").unlink()
    code, out = shardify("verify", nomlm_copy)
    lines = out.splitlines()
    assert code == 1 and f"{TRAIN}: lengths index's sha256 differs from the manifest's (damaged, or another " \
                         "dataset's)" in lines and "lengths/val.u16: missing (the lengths index the manifest lists)" \
                         in lines, out


def without_index(root: Path) -> None:
    """The dataset as the converter wrote it before the lengths index."""
    edit_manifest(root, lambda m: [info.pop("lengths") for info in m["splits"].values()])
    shutil.rmtree(root / "lengths")


def test_upgrade_adds_the_index_without_touching_shards_or_fingerprint(nomlm_copy: Path,
                                                                       nomlm_dataset: Path) -> None:
    without_index(nomlm_copy)
    old = json.loads((nomlm_copy / "manifest.json").read_text())
    shards = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in nomlm_copy.glob("*/*.tar")}
    code, out = shardify("inspect", nomlm_copy)
    assert code == 0 and "index        no lengths index (the token-budget plan decodes every block for them; " \
                         "`shardify upgrade DIR` adds one)" in out, out
    code, out = shardify("upgrade", nomlm_copy)
    assert code == 0 and out.endswith("lengths indexes lengths/train.u16, lengths/val.u16, lengths/all.u16\n"), out
    new = json.loads((nomlm_copy / "manifest.json").read_text())
    assert new["fingerprint"] == old["fingerprint"] == read_manifest(nomlm_dataset).fingerprint
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in nomlm_copy.glob("*/*.tar")} == shards
    for name in ("train", "val", "all"):  # the converter's index, byte for byte
        assert new["splits"][name] == json.loads((nomlm_dataset / "manifest.json").read_text())["splits"][name]
        assert (nomlm_copy / f"lengths/{name}.u16").read_bytes() == (nomlm_dataset / f"lengths/{name}.u16").read_bytes()
    m = read_manifest(nomlm_copy)
    assert np.array_equal(split_lengths(str(nomlm_copy), m, "train")[0],
                          split_lengths(str(nomlm_copy), m, "train", index=False)[0])
    # idempotent: a second upgrade writes the same manifest and leaves the index files alone
    text, stamp = (nomlm_copy / "manifest.json").read_text(), (nomlm_copy / TRAIN).stat().st_mtime_ns
    assert shardify("upgrade", nomlm_copy)[0] == 0
    assert (nomlm_copy / "manifest.json").read_text() == text and (nomlm_copy / TRAIN).stat().st_mtime_ns == stamp
    code, out = shardify("verify", nomlm_copy)
    assert code == 0, out


def test_upgrade_refuses_a_dataset_whose_index_disagrees(nomlm_copy: Path) -> None:
    before = (nomlm_copy / "manifest.json").read_text()
    (nomlm_copy / TRAIN).write_bytes((nomlm_copy / TRAIN).read_bytes()[:-2])
    code, out = shardify("upgrade", nomlm_copy)
    assert code == 1 and f"{TRAIN}: lengths index of 11128 bytes, the manifest lists 11130" in out, out
    assert (nomlm_copy / "manifest.json").read_text() == before


def test_inspect_says_where_the_index_is(nomlm_dataset: Path) -> None:
    code, out = shardify("inspect", nomlm_dataset)
    assert code == 0 and "index        lengths of train lengths/train.u16 (uint16), val lengths/val.u16 (uint16), " \
                         "all lengths/all.u16 (uint16)\n" in out, out


def test_overwrite_replaces_the_index_with_the_dataset(sample: Path, tmp_path: Path) -> None:
    """The old dataset's index files are its own: --overwrite replaces them (a file in the way would be refused),
    and a new dataset without a split removes that split's index."""
    h5 = sample / "encoded_nomlm.h5"
    assert shardify("convert", h5, "-o", tmp_path / "ds", "--all")[0] == 0
    code, out = shardify("convert", h5, "-o", tmp_path / "ds", "--seed", 1, "--overwrite")
    assert code == 0, out
    assert sorted(p.name for p in (tmp_path / "ds" / "lengths").iterdir()) == ["train.u16", "val.u16"]
    assert shardify("verify", tmp_path / "ds")[0] == 0
