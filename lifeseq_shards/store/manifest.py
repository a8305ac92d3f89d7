"""The manifest: a dataset's typed description (frozen dataclasses), parsed and validated from JSON in one place.

Parsing is pure (:func:`parse_manifest`: bytes -> :class:`Manifest`), and this module reads nothing: a dataset's
``manifest.json`` is read from a directory, an http(s) base or a ``pipe:`` command at the I/O edge
(:func:`lifeseq_shards.store.remote.read_manifest`). :func:`write_manifest` writes a converted dataset's, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .format import (
    CHECKSUMMED_VERSION,
    COUNT_OF,
    RAGGED,
    READABLE_VERSIONS,
    RUN_LENGTH,
    RUNS,
    SCALAR,
    TAGGED_VERSION,
    Field,
    schema_json,
    schema_tag,
)
from .shardfile import ShardFile
from .writes import discard, writing

MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """The manifest cannot be read or is not one this package writes (a key missing, a path leaving the dataset,
    a schema that cannot be, an edit that its fingerprint gives away); the message is one line naming the file."""


@dataclass(frozen=True)
class ShardEntry:
    """One shard file of a split: where it is (relative to the dataset root) and what it holds."""

    file: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    head_checksum: int | None = None  # format 3: the first block's zstd checksum (None for a shard without persons)
    block_checksums: tuple[int, ...] | None = None  # format 4, or upgraded: every block's zstd checksum

    def to_json(self, tagged: bool) -> dict[str, Any]:
        """``tagged``: format 3 and later, which always write ``head_checksum`` (null for an empty shard)."""
        out: dict[str, Any] = {"file": self.file, "samples": self.samples, "tokens": self.tokens,
                               "bytes": self.bytes, "sha256": self.sha256}
        if tagged:
            out["head_checksum"] = self.head_checksum
        if self.block_checksums is not None:  # 8 hex digits a block: one line, not a line a block
            out["block_checksums"] = "".join(f"{c:08x}" for c in self.block_checksums)
        return out


@dataclass(frozen=True)
class LengthsIndex:
    """A split's lengths index: every person's length (real tokens) in the split's order (its shards in manifest
    order, then the remainder), as raw little-endian ``dtype`` (uint16, uint32 or uint64) in ``file``; ``bytes`` and
    ``sha256`` as a shard's. Optional: a dataset converted before it has none (store/lengths.py)."""

    file: str
    dtype: str
    persons: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "persons": self.persons, "bytes": self.bytes,
                "sha256": self.sha256}


@dataclass(frozen=True)
class Split:
    """A split's shards of exactly ``shard_persons`` each, the remainder shard that training skips, and (optional)
    the index of its persons' lengths."""

    persons: int
    shard_persons: int
    shards: tuple[ShardEntry, ...]
    remainder: ShardEntry | None
    lengths: LengthsIndex | None = None

    def entries(self, remainder: bool = True) -> tuple[ShardEntry, ...]:
        """The shards in manifest order, then (with ``remainder``) the remainder shard if there is one."""
        return self.shards + ((self.remainder,) if remainder and self.remainder else ())

    @property
    def remainder_persons(self) -> int:
        return self.remainder.samples if self.remainder else 0

    def to_json(self, tagged: bool) -> dict[str, Any]:
        """``tagged``: as :meth:`ShardEntry.to_json`. Without a lengths index, what earlier versions wrote."""
        out: dict[str, Any] = {"persons": self.persons, "shard_persons": self.shard_persons,
                               "shards": [e.to_json(tagged) for e in self.shards],
                               "remainder": self.remainder.to_json(tagged) if self.remainder else None}
        return out if self.lengths is None else {**out, "lengths": self.lengths.to_json()}


@dataclass(frozen=True)
class Totals:
    persons: int  # train + val (the `all` split repeats them)
    bytes: int
    shards: int
    tokens: int
    input_rows: int | None = None  # rows read from the inputs, before filtering
    dropped: Mapping[str, int] | None = None  # input rows the converter dropped, by reason (sources/drops.py)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"persons": self.persons, "bytes": self.bytes, "shards": self.shards,
                               "tokens": self.tokens}
        if self.input_rows is not None:
            out["input_rows"] = self.input_rows
        return out if self.dropped is None else {**out, "dropped": dict(self.dropped)}


@dataclass(frozen=True)
class Histogram:
    """Persons by sequence length, in bins of ``bin_width`` tokens."""

    bin_width: int
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    """A dataset's manifest.json. ``params`` (what the conversion was run with) is free-form but for its
    ``vocab_size``; everything else is checked when parsed."""

    format_version: int
    schema: tuple[Field, ...]
    block_persons: int
    splits: Mapping[str, Split]
    totals: Totals
    fingerprint: str
    length_histogram: Histogram
    params: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, m: Any) -> Manifest:
        """ValueError naming the first key or value that this package would not have written, or could not read."""
        _has(m, _TOP, "the manifest")
        version = m["format_version"]
        if version not in READABLE_VERSIONS:
            raise ValueError(f"format version {version} (this reader reads {', '.join(map(str, READABLE_VERSIONS))})")
        if m["block_persons"] < 1:
            raise ValueError(f"block_persons is {m['block_persons']}")
        schema = _schema(m["schema"], version)
        totals, hist = m["totals"], m["length_histogram"]
        _has(totals, _TOTALS, "totals")
        _has(hist, _HISTOGRAM, "length_histogram")
        params = m.get("params")  # optional: what the conversion was run with
        if "params" in m and not (isinstance(params, dict)
                                  and isinstance(params.get("vocab_size", 0), (int, type(None)))):
            raise ValueError(f"params is {params!r}, not an object with an integer vocab_size")
        files: set[str] = set()
        splits = {name: _split(info, f"splits.{name}", version, files) for name, info in m["splits"].items()}
        return cls(version, schema, m["block_persons"], splits,
                   Totals(**{k: totals[k] for k in _TOTALS}, input_rows=totals.get("input_rows"),
                          dropped=_dropped(totals.get("dropped"))),
                   m["fingerprint"], Histogram(hist["bin_width"], tuple(hist["counts"])), params)

    def to_json(self) -> dict[str, Any]:
        """The JSON object the converter writes (key order included: byte for byte what earlier versions wrote)."""
        tagged = self.tagged
        out = {
            "format_version": self.format_version,
            "schema": [f.to_json() for f in self.schema],
            "block_persons": self.block_persons,
            "splits": {name: s.to_json(tagged) for name, s in self.splits.items()},
            "totals": self.totals.to_json(),
            "fingerprint": self.fingerprint,
            "length_histogram": {"bin_width": self.length_histogram.bin_width,
                                 "counts": list(self.length_histogram.counts)},
        }
        return out if self.params is None else {**out, "params": dict(self.params)}

    def entries(self) -> Iterator[tuple[str, ShardEntry]]:
        """(split, entry) for every shard file the manifest lists, remainders included, in manifest order."""
        for name, split in self.splits.items():
            for e in split.entries():
                yield name, e

    def files(self) -> list[str]:
        """Every file the manifest lists, relative to the dataset root: the shards in manifest order, then the
        lengths indexes (what a conversion moves into place, and what replacing the dataset deletes)."""
        return [e.file for _, e in self.entries()] + [s.lengths.file for s in self.splits.values() if s.lengths]

    @property
    def tagged(self) -> bool:
        """Whether the blocks carry the schema tag and the shards a head checksum (format 3 on)."""
        return self.format_version >= TAGGED_VERSION

    @property
    def tag(self) -> int | None:
        """The schema tag every block carries, or None before format 3 (format.schema_tag caches it per schema)."""
        return schema_tag(self.schema) if self.tagged else None

    @property
    def offline_mlm(self) -> bool:
        """Whether the dataset carries the seed's offline MLM fields (converted from its encoded_mlm.h5)."""
        return any(f.name == "masked_tokens" for f in self.schema)

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size the conversion recorded (None: an .h5 converted without --vocab)."""
        return (self.params or {}).get("vocab_size")

    @property
    def fingerprint_matches(self) -> bool:
        """Whether ``fingerprint`` is the one its schema and shard checksums make (False: edited by hand)."""
        return fingerprint(self.schema, [e.sha256 for _, e in self.entries()]) == self.fingerprint

    def shard_file(self, entry: ShardEntry, url: str) -> ShardFile:
        """What a reader checks the shard at ``url`` against."""
        return ShardFile(url, entry.samples, self.block_persons, entry.head_checksum if self.tagged else None,
                         self.tag, entry.block_checksums)


def fingerprint(schema: Sequence[Field], shard_hashes: Iterable[str]) -> str:
    """First 32 hex digits of sha256(the schema's canonical JSON, then every shard's sha256 in manifest order)."""
    h = hashlib.sha256(schema_json(schema))
    for s in shard_hashes:
        h.update(s.encode())
    return h.hexdigest()[:32]


def parse_manifest(data: bytes | str, where: str = MANIFEST) -> Manifest:
    """The manifest in ``data``; ManifestError, one line starting with ``where``, if it is not one we would write."""
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: manifest is not valid JSON ({e})") from None
    try:
        return Manifest.from_json(m)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from None


def write_manifest(out: Path, manifest: Manifest) -> None:
    """Written last, atomically: a directory without manifest.json is not a dataset. A failed write raises
    :class:`~lifeseq_shards.store.writes.WriteFailed` naming it, and leaves the manifest there before, if any."""
    tmp = out / (MANIFEST + ".tmp")
    try:
        with writing(out / MANIFEST):
            tmp.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=False))
            os.replace(tmp, out / MANIFEST)
    finally:
        discard(tmp)


# What each part of a manifest holds (key: type); a key that is missing or of another type is refused in one line.
_TOP = {"format_version": int, "schema": list, "block_persons": int, "splits": dict, "totals": dict,
        "length_histogram": dict, "fingerprint": str}
_FIELD = {"name": str, "dtype": str, "kind": str}
_SPLIT = {"persons": int, "shard_persons": int, "shards": list}
_ENTRY = {"file": str, "samples": int, "tokens": int, "bytes": int, "sha256": str}
_TOTALS = {"persons": int, "tokens": int, "bytes": int, "shards": int}
_HISTOGRAM = {"bin_width": int, "counts": list}
_LENGTHS = {"file": str, "dtype": str, "persons": int, "bytes": int, "sha256": str}
LENGTHS_DTYPES = ("uint16", "uint32", "uint64")  # a lengths index's dtypes, the narrowest that holds the schema's
_HEX = re.compile(r"[0-9a-f]*")
# a shard's path: relative, inside the dataset (no '..', no leading '/' or '.'), and nothing that the shell of a
# `pipe:` root, where it replaces {}, would read as syntax or as an option
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def _split(info: Any, at: str, version: int, files: set[str]) -> Split:
    _has(info, _SPLIT, at)
    if "remainder" not in info:
        raise ValueError(f"missing key 'remainder' in {at}")
    shards = tuple(_entry(e, f"{at}.shards[{j}]", version, files) for j, e in enumerate(info["shards"]))
    rem = info["remainder"]
    return Split(info["persons"], info["shard_persons"], shards,
                 None if rem is None else _entry(rem, f"{at}.remainder", version, files),
                 _lengths(info.get("lengths"), f"{at}.lengths", files))


def _lengths(info: Any, at: str, files: set[str]) -> LengthsIndex | None:
    """A split's lengths index: absent (converted before it existed), or one value a person, of a dtype it can be,
    in a file of exactly that many bytes (whether as many as the split's shards hold, its readers check: as the
    shards' counts, which the reader checks block by block)."""
    if info is None:
        return None
    _has(info, _LENGTHS, at)
    if info["dtype"] not in LENGTHS_DTYPES:
        raise ValueError(f"{at}.dtype is {info['dtype']!r}, not one of {', '.join(LENGTHS_DTYPES)}")
    persons, itemsize = info["persons"], np.dtype(info["dtype"]).itemsize
    if info["bytes"] != persons * itemsize:
        raise ValueError(f"{at}.bytes is {info['bytes']}, {persons} persons of {info['dtype']} make "
                         f"{persons * itemsize}")
    _listed(info["file"], f"{at}.file", files)
    return LengthsIndex(**{k: info[k] for k in _LENGTHS})


def _entry(e: Any, at: str, version: int, files: set[str]) -> ShardEntry:
    """One shard's entry; ``files`` collects the paths seen, so that a file listed twice is refused."""
    _has(e, _ENTRY, at)
    head = None
    if version >= TAGGED_VERSION:
        head = e.get("head_checksum", "missing")
        if not (isinstance(head, int) and 0 <= head < 1 << 32 or head is None and e["samples"] == 0):
            raise ValueError(f"{at}.head_checksum is {head!r}, not a 32-bit checksum")
    checksums = _block_checksums(e, at, version)
    if checksums and head is not None and checksums[0] != head:
        raise ValueError(f"{at}.head_checksum is not its first block's checksum in block_checksums")
    _listed(e["file"], f"{at}.file", files)
    return ShardEntry(**{k: e[k] for k in _ENTRY}, head_checksum=head, block_checksums=checksums)


def _listed(file: str, at: str, files: set[str]) -> None:
    """A dataset file's path: plain, relative, inside the dataset, and not listed before (``files`` collects them)."""
    if not _SAFE_FILE.fullmatch(file):
        raise ValueError(f"{at} {file!r} is not a plain relative path inside the dataset")
    if file in files:
        raise ValueError(f"{at} {file!r} is listed twice")
    files.add(file)


def _block_checksums(e: dict[str, Any], at: str, version: int) -> tuple[int, ...] | None:
    """Every block's checksum, 8 hex digits a block, in block order (whether they are as many as the blocks, the
    reader checks with the counts, block by block); required from format 4 on, and in an older format once
    `shardify upgrade` added them."""
    if "block_checksums" not in e and version < CHECKSUMMED_VERSION:
        return None
    text = e.get("block_checksums")
    if not (isinstance(text, str) and _HEX.fullmatch(text) and len(text) % 8 == 0):
        raise ValueError(f"{at}.block_checksums is {str(text)[:40]!r}, not 8 lowercase hex digits a block")
    return tuple(int(text[i : i + 8], 16) for i in range(0, len(text), 8))


def _dropped(value: Any) -> dict[str, int] | None:
    """totals.dropped: absent (converted before it was counted), or reason -> count."""
    if value is None:
        return None
    if not (isinstance(value, dict) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                            for n in value.values())):
        raise ValueError(f"totals.dropped is {value!r}, not an object of counts by reason")
    return value


def _has(obj: Any, keys: dict[str, type], at: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{at} is not an object")
    for key, kind in keys.items():
        if key not in obj:
            raise ValueError(f"missing key {key!r} in {at}")
        value = obj[key]
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{at}.{key} is {value!r}, not a count")
        if not isinstance(value, kind):
            raise ValueError(f"{at}.{key} is {value!r}, not a {kind.__name__}")


def _schema(items: list[Any], version: int) -> tuple[Field, ...]:
    """A schema that blocks can be decoded with: known kinds, integer dtypes, each count field before the fields it
    sizes, and runs (with their run_length) from format 2 on, none before."""
    seen: dict[str, str] = {}
    for j, item in enumerate(items):
        _has(item, _FIELD, f"schema[{j}]")
        name, dtype, kind = item["name"], item["dtype"], item["kind"]
        try:
            integer = np.dtype(dtype).kind in "iu"
        except TypeError:
            integer = False
        if not integer:
            raise ValueError(f"schema[{j}] ({name}): dtype {dtype!r} is not an integer dtype")
        if kind not in (SCALAR, *COUNT_OF):
            raise ValueError(f"schema[{j}] ({name}): unknown kind {kind!r}")
        if kind != SCALAR and seen.get(COUNT_OF[kind]) != SCALAR:
            raise ValueError(f"schema[{j}] ({name}): its count field {COUNT_OF[kind]!r} must come before it")
        if name in seen:
            raise ValueError(f"schema[{j}]: field {name!r} twice")
        seen[name] = kind
    for name, kind in (("person_id", SCALAR), ("length", SCALAR), ("tokens", RAGGED)):
        if seen.get(name) != kind:
            raise ValueError(f"schema: no {kind} field {name!r}")
    runs = [name for name, kind in seen.items() if kind == RUNS]
    if version == 1 and runs:
        raise ValueError(f"schema: format 1 stores no runs, but {', '.join(runs)} are")
    if version >= 2 and seen.get(RUN_LENGTH) != RUNS:
        raise ValueError(f"schema: format {version} stores the stamps once per run, but has no {RUN_LENGTH!r}")
    return tuple(Field(i["name"], i["dtype"], i["kind"]) for i in items)
