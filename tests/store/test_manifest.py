"""The typed manifest: parsed from JSON and written back byte for byte, read at the I/O edge, and the old dict-style
and format-module ways in still working (with a DeprecationWarning)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import to_format2

from lifeseq_shards import ShardedDataset
from lifeseq_shards.reader import World
from lifeseq_shards.store.manifest import Manifest, ManifestError, parse_manifest, write_manifest
from lifeseq_shards.store.remote import read_manifest


@pytest.mark.parametrize("name", ["mlm_dataset", "nomlm_dataset"])
def test_the_manifest_round_trips_byte_for_byte(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """What the converter wrote == what the typed manifest writes back (the fingerprint and key order included)."""
    root: Path = request.getfixturevalue(name)
    text = (root / "manifest.json").read_text()
    m = parse_manifest(text.encode())
    write_manifest(tmp_path, m)
    assert (tmp_path / "manifest.json").read_text() == text
    assert m.fingerprint_matches and m == read_manifest(root)


def test_older_formats_round_trip_without_head_checksums(nomlm_dataset: Path) -> None:
    """Format 2 has no head_checksum: none is read, none is written back."""
    raw = json.loads((nomlm_dataset / "manifest.json").read_text())
    to_format2(raw)
    m = Manifest.from_json(raw)
    assert m.tag is None and all(e.head_checksum is None for _, e in m.entries())
    assert m.to_json() == raw
    assert m.shard_file(m.splits["train"].shards[0], "x").head_checksum is None


def test_typed_views(mlm_dataset: Path, nomlm_dataset: Path) -> None:
    m = read_manifest(mlm_dataset)
    train = m.splits["train"]
    assert train.remainder is not None and train.entries()[-1] == train.remainder
    assert train.entries(remainder=False) == train.shards and train.remainder_persons == train.remainder.samples
    assert [e.file for _, e in m.entries()][:2] == ["train/shard-000000.tar", "train/shard-000001.tar"]
    assert m.offline_mlm and not read_manifest(nomlm_dataset).offline_mlm
    assert m.vocab_size is None  # an .h5 converted without --vocab
    assert m.tag is not None and m.shard_file(train.shards[0], "u").tag == m.tag
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.block_persons = 1  # type: ignore[misc]


def test_parsing_is_pure_and_names_the_source(mlm_dataset: Path) -> None:
    with pytest.raises(ManifestError, match=r"^s3://b/ds/manifest\.json: manifest is not valid JSON"):
        parse_manifest(b"{", "s3://b/ds/manifest.json")
    with pytest.raises(ManifestError, match=r"^manifest\.json: the manifest is not an object"):
        parse_manifest(b"[]")
    raw = json.loads((mlm_dataset / "manifest.json").read_text())
    with pytest.raises(ManifestError, match="params is None, not an object"):  # optional, but not null
        parse_manifest(json.dumps({**raw, "params": None}))
    del raw["params"]
    assert parse_manifest(json.dumps(raw)).vocab_size is None and "params" not in parse_manifest(
        json.dumps(raw)).to_json()


def test_the_manifest_is_no_dict(mlm_dataset: Path) -> None:
    """Its attributes, or to_json() for the JSON: the dict-style reads fail as on any object without them."""
    m = ShardedDataset(mlm_dataset, "train", batch_size=8, world=World(0, 1)).manifest
    assert m.to_json()["splits"]["train"]["persons"] == m.splits["train"].persons
    with pytest.raises(TypeError, match="'Manifest' object is not subscriptable"):
        m["splits"]  # noqa: B018
    with pytest.raises(AttributeError, match="'Manifest' object has no attribute 'get'"):
        m.get("params", {})
    with pytest.raises(TypeError, match="argument of type 'Manifest' is not iterable"):
        "splits" in m  # noqa: B015


@pytest.mark.parametrize(("name", "home"), [("read_manifest", "remote"), ("ShardFile", "shardfile"),
                                            ("write_shard", "shardfile"), ("MANIFEST", "manifest")])
def test_moved_names_import_only_from_their_modules(name: str, home: str) -> None:
    import importlib

    assert hasattr(importlib.import_module(f"lifeseq_shards.store.{home}"), name)
    with pytest.raises(ImportError, match=f"cannot import name '{name}' from 'lifeseq_shards.store.format'"):
        exec(f"from lifeseq_shards.store.format import {name}")
