"""The typed manifest: parsed from JSON and written back byte for byte, read at the I/O edge, and the old dict-style
and format-module ways in still working (with a DeprecationWarning); a manifest edited by hand (paths leaving the
dataset, counts, keys, types, the schema) refused in one line naming it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import ManifestJSON, assert_one_line_exit_2, edit_manifest, swap_fields, to_format2

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
    m = ShardedDataset(mlm_dataset, split="train", batch_size=8, world=World(0, 1)).manifest
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


# -- a manifest edited by hand: refused in one line naming it (the CLI: exit 2) ---------------------------------------
def test_an_edited_schema_is_given_away_by_the_fingerprint(nomlm_copy: Path) -> None:
    """Without the refit, format-2 datasets (no schema tag in their blocks) are protected too."""
    edit_manifest(nomlm_copy, lambda m: (to_format2(m), swap_fields("age", "segment")(m)))
    with pytest.raises(ManifestError, match=r"manifest\.json: fingerprint does not match"):
        ShardedDataset(nomlm_copy)


def test_a_count_unlike_the_others_names_the_manifest_and_the_shard(nomlm_copy: Path) -> None:
    """Before: `balanced mode needs shards of one size, got sizes [115, 116]`, naming no dataset or shard."""
    def raise_one(m: ManifestJSON) -> None:
        m["splits"]["train"]["shards"][5]["samples"] += 1

    edit_manifest(nomlm_copy, raise_one)
    with pytest.raises(ManifestError, match=rf"{re.escape(str(nomlm_copy))}/manifest\.json: split train: shard "
                                            r"train/shard-000005\.tar counts 116 persons, the split's other shards "
                                            r"115 each"):
        ShardedDataset(nomlm_copy)


@pytest.mark.parametrize("file", ["../escape.tar", "/etc/hostname", "train/../../escape.tar", "./train/x.tar",
                                  "train/shard-000001.tar; touch pwned", ""])
def test_a_shard_path_leaving_the_dataset_is_refused(nomlm_copy: Path, file: str) -> None:
    """Before: the reader opened ../escape.tar (and a `pipe:` root would run what follows a ';')."""
    edit_manifest(nomlm_copy, lambda m: m["splits"]["train"]["shards"][0].update(file=file))
    needle = f"manifest.json: splits.train.shards[0].file {file!r} is not a plain relative path inside the dataset"
    with pytest.raises(ManifestError) as err:
        ShardedDataset(nomlm_copy)
    assert needle in str(err.value)
    assert_one_line_exit_2(["verify", str(nomlm_copy)], needle)


def test_a_shard_listed_twice_is_refused(nomlm_copy: Path) -> None:
    """Before: its persons read twice."""
    edit_manifest(nomlm_copy, lambda m: m["splits"]["train"]["shards"][1].update(file="train/shard-000000.tar"))
    with pytest.raises(ManifestError, match=r"shards\[1\]\.file 'train/shard-000000.tar' is listed twice"):
        ShardedDataset(nomlm_copy)


@pytest.mark.parametrize("params", [[], {"vocab_size": "2971"}])
def test_conversion_params_of_another_type_are_one_line(nomlm_copy: Path, params: object) -> None:
    """Before: a traceback from verify (a str compared with token ids) or from inspect."""
    edit_manifest(nomlm_copy, lambda m: m.update(params=params))
    assert_one_line_exit_2(["verify", str(nomlm_copy)], "manifest.json: params is")


def test_verify_checks_the_format_version(nomlm_copy: Path) -> None:
    """Before: verify said OK to a format-1 manifest whose schema stores runs."""
    edit_manifest(nomlm_copy, lambda m: m.update(format_version=1))
    needle = "manifest.json: schema: format 1 stores no runs, but run_length, abspos, age, segment are"
    assert_one_line_exit_2(["verify", str(nomlm_copy)], needle)
    with pytest.raises(ManifestError, match=needle):
        ShardedDataset(nomlm_copy)


@pytest.mark.parametrize(("where", "key", "at"), [
    (("splits", "train", "shards", 0), "file", " in splits.train.shards[0]"),
    (("splits", "val", "shards", 1), "samples", " in splits.val.shards[1]"),
    (("splits", "train"), "remainder", " in splits.train"),
    (("schema", 2), "dtype", " in schema[2]"),
    (("totals",), "tokens", " in totals"),
    ((), "block_persons", " in the manifest"),
])
def test_a_manifest_missing_a_key_is_one_line(nomlm_copy: Path, where: tuple[Any, ...], key: str, at: str) -> None:
    """Before: KeyError in the reader, a traceback from verify, inspect and plan."""
    def drop(m: ManifestJSON) -> None:
        obj: Any = m
        for k in where:
            obj = obj[k]
        del obj[key]

    edit_manifest(nomlm_copy, drop)
    needle = f"manifest.json: missing key '{key}'{at}"
    with pytest.raises(ManifestError) as err:
        ShardedDataset(nomlm_copy)
    assert needle in str(err.value)
    for args in (["verify"], ["inspect"], ["plan", "--batch-size", "64"]):
        assert_one_line_exit_2([args[0], str(nomlm_copy), *args[1:]], needle)
