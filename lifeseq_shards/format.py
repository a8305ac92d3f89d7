"""The on-disk format: field schema, the columnar block codec, shard (tar) writing and the manifest.

A shard is a plain tar file. Each member ``NNNNNN.block.zst`` holds a *block* of persons, zstd-compressed, in a
columnar layout that ``np.frombuffer`` reads without parsing (docs/format.md gives it byte for byte). Persons are
never one tar member each: a 512-byte tar header per person and a per-person ``np.load`` are what made the
one-member-per-field layout slow and large (tools/bench_layouts.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

FORMAT_VERSION = 3
# format 1 stored the stamps once per token; format 2 had neither the blocks' schema tag nor the shards' head_checksum
READABLE_VERSIONS = (1, 2, 3)
TAGGED_VERSION = 3
MAGIC = b"LSB1"
BLOCK_SUFFIX = ".block.zst"
MANIFEST = "manifest.json"
# default smallest shard: 4 blocks of 256, so a shard's file open, tar headers and short last block cost little per
# person (docs/performance.md, change 12)
MIN_SHARD_PERSONS = 1024
ALIGN = 8

# kind: "scalar" = one value per person; "ragged" = `length` values per person; "targets" = `n_targets` values;
# "runs" = `n_runs` values: the stamps once per run of tokens that share them (an event's tokens do), with the run's
# `run_length` in tokens. Runs halve the decoded bytes and make decompression 2.4x faster (docs/performance.md).
SCALAR, RAGGED, TARGETS, RUNS = "scalar", "ragged", "targets", "runs"
COUNT_OF = {RAGGED: "length", TARGETS: "n_targets", RUNS: "n_runs"}
RUN_LENGTH = "run_length"
STAMPS = ("abspos", "age", "segment")


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str
    kind: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "dtype": self.dtype, "kind": self.kind}


def make_schema(token_dtype: str, dtypes: dict[str, str] | None = None, offline_mlm: bool = False) -> list[Field]:
    """The field list in block order: the counts (`length`, `n_targets`) come before the fields they size."""
    d = {"abspos": "int16", "age": "uint8", "segment": "uint8", "length": "uint16", **(dtypes or {})}
    n = d["length"]  # every count of, or position in, a sequence: `--dtype length=...` widens them together
    fields = [Field("person_id", "int64", SCALAR), Field("length", n, SCALAR), Field("n_runs", n, SCALAR)]
    if offline_mlm:
        fields += [Field("n_targets", n, SCALAR), Field("target_cls", "uint8", SCALAR)]
    fields += [Field("tokens", token_dtype, RAGGED), Field(RUN_LENGTH, n, RUNS)]
    fields += [Field(name, d[name], RUNS) for name in STAMPS]
    if offline_mlm:
        fields += [
            Field("masked_tokens", token_dtype, RAGGED),
            Field("target_pos", n, TARGETS),
            Field("target_tokens", token_dtype, TARGETS),
        ]
    return fields


def has_offline_mlm(manifest: dict[str, Any]) -> bool:
    """Whether the dataset carries the seed's offline MLM fields (converted from its encoded_mlm.h5)."""
    return any(f["name"] == "masked_tokens" for f in manifest["schema"])


def token_schema(schema: list[Field]) -> list[Field]:
    """The schema with the stamps once per token (format 1's layout): what sources produce and padded batches hold."""
    return [Field(f.name, f.dtype, RAGGED if f.kind == RUNS else f.kind) for f in schema
            if f.name not in ("n_runs", RUN_LENGTH)]


def schema_from_json(items: list[dict[str, str]]) -> list[Field]:
    return [Field(i["name"], i["dtype"], i["kind"]) for i in items]


def schema_json(schema: list[Field]) -> bytes:
    """The schema's canonical JSON: what the fingerprint and the blocks' schema tag are computed from."""
    return json.dumps([f.to_json() for f in schema], sort_keys=True).encode()


def schema_tag(schema: list[Field]) -> int:
    """The 32-bit tag every format-3 block carries in its header: a block decoded with another schema (fields
    swapped or renamed in the manifest) is refused instead of read into the wrong fields."""
    return zlib.crc32(schema_json(schema))


def manifest_tag(manifest: dict[str, Any], schema: list[Field]) -> int | None:
    """The schema tag a manifest's blocks carry, or None for formats before it (no tag, no head checksum)."""
    return schema_tag(schema) if manifest["format_version"] >= TAGGED_VERSION else None


def narrowest_token_dtype(vocab_size: int) -> str:
    for dt in ("uint8", "uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit uint32")


class ValueRangeError(ValueError):
    """A value does not fit the dtype chosen for its field (the message names the field and the person)."""


def check_fits(name: str, values: np.ndarray, dtype: str, where: str) -> None:
    if values.size == 0:
        return
    info = np.iinfo(dtype)
    lo, hi = int(values.min()), int(values.max())
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ValueRangeError(
            f"{where}: field {name!r} value {bad} does not fit {dtype} [{info.min}, {info.max}]"
            f" (choose a wider one with --dtype {name}=int32)"
        )


def ragged_counts(schema: list[Field]) -> set[str]:
    """The count fields (``length``, ``n_targets``, ``n_runs``) that size the schema's non-scalar fields."""
    return {COUNT_OF[f.kind] for f in schema if f.kind != SCALAR}


# ---------------------------------------------------------------------------------------------------------------
# Blocks: a group of persons, columnar.


@dataclass
class Block:
    """Columns of ``n`` persons. Scalar columns have shape (n,); ragged ones are concatenated over persons."""

    columns: dict[str, np.ndarray]
    _offsets: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.columns["person_id"])

    def offsets(self, count: str = "length") -> np.ndarray:
        """Start offsets (n+1) of each person's values in the ragged columns sized by ``count`` (computed once: a
        reader gathers many batches from one block)."""
        if count not in self._offsets:
            out = np.zeros(self.n + 1, dtype=np.int64)
            np.cumsum(self.columns[count], out=out[1:])
            self._offsets[count] = out
        return self._offsets[count]

    def gather_index(self, index: np.ndarray, count: str = "length") -> np.ndarray:
        """Flat positions of the ragged values (sized by ``count``) of persons ``index``, in that order."""
        return _ragged_gather(self.offsets(count), index)

    def slice(self, start: int, stop: int, schema: list[Field]) -> Block:
        """Persons [start, stop) as views (no copy): the cheap way to cut consecutive persons."""
        offs = {c: self.offsets(c) for c in ragged_counts(schema)}
        cols = {}
        for f in schema:
            col = self.columns[f.name]
            if f.kind == SCALAR:
                cols[f.name] = col[start:stop]
            else:
                o = offs[COUNT_OF[f.kind]]
                cols[f.name] = col[o[start] : o[stop]]
        return Block(cols)

    def take(self, index: np.ndarray, schema: list[Field]) -> Block:
        """The persons at ``index`` (in that order) as a new block."""
        cols: dict[str, np.ndarray] = {}
        gathers = {c: self.gather_index(index, c) for c in ragged_counts(schema)}
        for f in schema:
            col = self.columns[f.name]
            cols[f.name] = col[index] if f.kind == SCALAR else col[gathers[COUNT_OF[f.kind]]]
        return Block(cols)


def _ragged_gather(offsets: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Flat positions of the ragged values of persons ``index`` (concatenated in that order): a running sum of
    steps of 1, with a jump at each person's first value (two passes over the output, not arange + repeat + add)."""
    starts = offsets[index]
    lens = offsets[index + 1] - starts
    if not lens.all():  # persons without values (e.g. no targets) have no first value to jump to
        starts, lens = starts[lens > 0], lens[lens > 0]
    if not len(lens):
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lens)
    steps = np.ones(int(ends[-1]), dtype=np.int64)
    steps[0] = starts[0]
    steps[ends[:-1]] = starts[1:] - (starts[:-1] + lens[:-1]) + 1
    return np.cumsum(steps, out=steps)


def concat_blocks(blocks: list[Block], schema: list[Field]) -> Block:
    return Block({f.name: np.concatenate([b.columns[f.name] for b in blocks]) for f in schema})


def _run_fields(schema: list[Field]) -> list[str]:
    """The fields stored once per run (none in format 1)."""
    return [f.name for f in schema if f.kind == RUNS and f.name != RUN_LENGTH]


def to_runs(block: Block, schema: list[Field]) -> Block:
    """Per-token stamps (a ``token_schema`` block) -> ``schema``'s runs: a run starts at each person's first token
    and wherever a stamp changes, so :func:`expand_runs` gives the same tokens back."""
    stamps = _run_fields(schema)
    if not stamps:
        return block
    c, offs = block.columns, block.offsets()
    n_tok = int(offs[-1])
    start = np.zeros(n_tok, dtype=bool)
    start[offs[:-1][c["length"] > 0]] = True
    for name in stamps:
        start[1:] |= c[name][1:] != c[name][:-1]
    first = np.flatnonzero(start)
    seen = np.zeros(n_tok + 1, dtype=np.int64)
    np.cumsum(start, out=seen[1:])
    dtype = {f.name: f.dtype for f in schema}
    cols = dict(c, n_runs=(seen[offs[1:]] - seen[offs[:-1]]).astype(dtype["n_runs"]))
    cols[RUN_LENGTH] = np.diff(np.append(first, n_tok)).astype(dtype[RUN_LENGTH])
    cols.update({name: c[name][first] for name in stamps})
    return Block({f.name: cols[f.name] for f in schema})


def expand_runs(block: Block, schema: list[Field]) -> Block:
    """The block with every stamp once per token again (``token_schema(schema)``'s layout)."""
    runs = _run_fields(schema)
    if not runs:
        return block
    reps = block.columns[RUN_LENGTH]
    return Block({f.name: np.repeat(block.columns[f.name], reps) if f.name in runs else block.columns[f.name]
                  for f in token_schema(schema)})


def encode_block(block: Block, schema: list[Field]) -> bytes:
    """Raw (uncompressed) block payload: MAGIC, uint32 n, uint32 schema tag, then each field's values, 8-byte
    aligned."""
    parts = [MAGIC, struct.pack("<II", block.n, schema_tag(schema))]
    for f in schema:
        raw = np.ascontiguousarray(block.columns[f.name], dtype=np.dtype(f.dtype).newbyteorder("<")).tobytes()
        parts.append(raw)
        if len(raw) % ALIGN:
            parts.append(b"\0" * (ALIGN - len(raw) % ALIGN))
    return b"".join(parts)


def decode_block(payload: bytes | memoryview, schema: list[Field], tag: int | None = None) -> Block:
    """Inverse of :func:`encode_block`: zero-copy views into ``payload``; with ``tag``, the block must carry it."""
    if bytes(payload[:4]) != MAGIC:
        raise ValueError("not a lifeseq block (bad magic)")
    (n, got) = struct.unpack_from("<II", payload, 4)
    if tag is not None and got != tag:
        raise ValueError(f"block written with another schema (tag {got:08x}, the manifest's schema makes {tag:08x}:"
                         " fields swapped or renamed in the manifest?)")
    pos = 12
    cols: dict[str, np.ndarray] = {}
    totals: dict[str, int] = {}
    for f in schema:
        dt = np.dtype(f.dtype).newbyteorder("<")
        count = n if f.kind == SCALAR else totals[COUNT_OF[f.kind]]
        nbytes = count * dt.itemsize
        if pos + nbytes > len(payload):
            raise ValueError(f"block truncated in field {f.name!r}")
        cols[f.name] = np.frombuffer(payload, dtype=dt, count=count, offset=pos)
        pos += nbytes + (-nbytes) % ALIGN
        if f.name in COUNT_OF.values():
            totals[f.name] = int(cols[f.name].sum(dtype=np.int64))
    if pos != len(payload):
        raise ValueError(f"block has {len(payload) - pos} trailing bytes")
    return Block(cols)


_DCTX = zstandard.ZstdDecompressor()


def decompress(data: bytes) -> bytes:
    return _DCTX.decompress(data)


def decode_member(data: bytes, schema: list[Field], tag: int | None = None) -> Block:
    return decode_block(decompress(data), schema, tag)


# ---------------------------------------------------------------------------------------------------------------
# Shards: tar files of blocks, written to a temp name and renamed when complete.


def block_member_name(i: int) -> str:
    return f"{i:06d}{BLOCK_SUFFIX}"


def write_shard(path: Path, blocks: Iterable[Block], schema: list[Field], level: int = 9) -> dict[str, Any]:
    """Write a shard atomically; returns its manifest entry (without the file name)."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)  # decoding catches a flipped byte
    tmp = path.with_name(path.name + ".tmp")
    persons = tokens = 0
    head = None
    with open(tmp, "wb") as fh:
        for i, block in enumerate(blocks):
            data = cctx.compress(encode_block(block, schema))
            if i == 0:
                head = frame_checksum(data)
            fh.write(tar_member(block_member_name(i), data))
            persons += block.n
            tokens += int(block.columns["length"].sum(dtype=np.int64))
        fh.write(b"\0" * 1024)  # end-of-archive marker, without tarfile's padding to 10 KiB records
    os.replace(tmp, path)
    return {"samples": persons, "tokens": tokens, "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "head_checksum": head}


def frame_checksum(frame: bytes) -> int:
    """A zstd frame's content checksum (its last 4 bytes: XXH64 of the decompressed block, low 32 bits), read, not
    computed: what identifies a shard's first block for nothing."""
    return int.from_bytes(frame[-4:], "little")


def tar_member(name: str, data: bytes) -> bytes:
    """One ustar member: header, data, zero padding to 512 bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def iter_tar_members(stream: Any) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular member of a ustar stream, read sequentially (works on pipes and HTTP).

    A lean reader of the plain ustar files :func:`write_shard` makes (``tarfile`` spent ~100 us a shard on
    headers, a fifth of the reader's time on small shards); pax and GNU long-name headers, which it never
    writes, are refused rather than misread."""
    while True:
        header = _read_exactly(stream, 512)
        if not header or header == _ZERO_BLOCK:
            return  # end-of-archive marker, or a stream that stops between members
        if len(header) < 512:
            raise OSError("tar: truncated header")
        if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):
            raise OSError("tar: bad header checksum")
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            raise OSError(f"tar: extended header {kind.decode()!r} not supported")
        size = _octal(header[124:136])
        if size < 0:
            raise OSError("tar: bad size field")
        data = _read_exactly(stream, size)
        if len(data) < size:
            raise OSError(f"tar: member data truncated ({len(data)} of {size} bytes)")
        _read_exactly(stream, -size % 512)  # the member's zero padding
        if kind in (b"0", b"\0"):
            name = header[:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\0" else b""
            yield (prefix + b"/" + name if prefix else name).decode(), data


_ZERO_BLOCK = bytes(512)


def _octal(field: bytes) -> int:
    """A ustar number field (octal digits, NUL or space terminated); -1 when it is not one, so a damaged header
    fails its checksum test instead of raising an unrelated error."""
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else -1
    except ValueError:
        return -1


def _read_exactly(stream: Any, size: int) -> bytes:
    """``size`` bytes, fewer only at the end of the stream (pipes and sockets return short reads)."""
    data = stream.read(size)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = stream.read(size - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


@dataclass(frozen=True)
class ShardFile:
    """One shard file as the manifest describes it. Readers check each member they meet against it, for nearly
    nothing (a name, a count, the first block's zstd checksum, the schema tag in each block's header): a shard
    copied over another, one from another conversion, edited counts or block size, or an edited schema are refused
    at read time, not read into wrong or missing persons."""

    url: str
    samples: int
    block_persons: int
    head_checksum: int | None = None  # format 3: the first block's zstd checksum
    tag: int | None = None  # format 3: the schema tag in every block's header

    @classmethod
    def of(cls, url: str, entry: dict[str, Any], manifest: dict[str, Any], tag: int | None) -> ShardFile:
        """``tag``: :func:`manifest_tag`, computed once for all of a manifest's shards."""
        return cls(url, entry["samples"], manifest["block_persons"], entry["head_checksum"] if tag is not None
                   else None, tag)

    @property
    def blocks(self) -> int:
        return -(-self.samples // self.block_persons)

    def check_member(self, i: int, name: str, data: bytes) -> None:
        """ValueError unless member ``i`` is one the manifest promises, under its name (and the shard's own)."""
        if i >= self.blocks:
            raise ValueError(f"more blocks than the manifest's {self.samples} persons in blocks of "
                             f"{self.block_persons} make")
        if name != block_member_name(i):
            raise ValueError(f"member {name!r} where {block_member_name(i)!r} belongs")
        if i == 0 and self.head_checksum is not None and frame_checksum(data) != self.head_checksum:
            raise ValueError("not the shard the manifest names (its first block's checksum differs: a shard copied "
                             "over it, or one from another conversion)")

    def check_block(self, i: int, block: Block) -> None:
        """ValueError unless block ``i`` holds the persons the manifest's counts give it."""
        want = min(self.block_persons, self.samples - i * self.block_persons)
        if block.n != want:
            raise ValueError(f"{block.n} persons, where the manifest's {self.samples} persons in blocks of "
                             f"{self.block_persons} put {want}")


def read_shard_blocks(path: str | os.PathLike[str], schema: list[Field]) -> Iterator[Block]:
    """Every block of a local shard file, in order, with the stamps once per token (``token_schema(schema)``)."""
    with open(path, "rb") as fh:
        for _name, data in iter_tar_members(fh):
            yield expand_runs(decode_member(data, schema), schema)


# ---------------------------------------------------------------------------------------------------------------
# Manifest


def fingerprint(schema: list[Field], shard_hashes: Iterable[str]) -> str:
    h = hashlib.sha256(schema_json(schema))
    for s in shard_hashes:
        h.update(s.encode())
    return h.hexdigest()[:32]


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Written last, atomically: a directory without manifest.json is not a dataset."""
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False))
    os.replace(tmp, out / MANIFEST)


class ManifestError(ValueError):
    """The manifest cannot be read or is not one this package writes (a key missing, a path leaving the dataset,
    a schema that cannot be, an edit that its fingerprint gives away); the message is one line naming the file."""


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """The fingerprint the manifest's schema and shard checksums make (it must equal ``manifest["fingerprint"]``)."""
    return fingerprint(schema_from_json(manifest["schema"]), [e["sha256"] for _, e in shard_entries(manifest)])


def shard_entries(manifest: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(split, entry) for every shard file the manifest lists, remainders included, in manifest order."""
    for split, info in manifest["splits"].items():
        for e in info["shards"]:
            yield split, e
        if info["remainder"]:
            yield split, info["remainder"]


# What each part of a manifest holds (key: type); a key that is missing or of another type is refused in one line.
_TOP = {"format_version": int, "schema": list, "block_persons": int, "splits": dict, "totals": dict,
        "length_histogram": dict, "fingerprint": str}
_FIELD = {"name": str, "dtype": str, "kind": str}
_SPLIT = {"persons": int, "shard_persons": int, "shards": list}
_ENTRY = {"file": str, "samples": int, "tokens": int, "bytes": int, "sha256": str}
_TOTALS = {"persons": int, "tokens": int, "bytes": int, "shards": int}
_HISTOGRAM = {"bin_width": int, "counts": list}
# a shard's path: relative, inside the dataset (no '..', no leading '/' or '.'), and nothing that the shell of a
# `pipe:` root, where it replaces {}, would read as syntax or as an option
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def _check_manifest(m: Any) -> None:
    """ValueError naming the first key or value that this package would not have written, or could not read."""
    _has(m, _TOP, "the manifest")
    version = m["format_version"]
    if version not in READABLE_VERSIONS:
        raise ValueError(f"format version {version} (this reader reads {', '.join(map(str, READABLE_VERSIONS))})")
    if m["block_persons"] < 1:
        raise ValueError(f"block_persons is {m['block_persons']}")
    _check_schema(m["schema"], version)
    _has(m["totals"], _TOTALS, "totals")
    _has(m["length_histogram"], _HISTOGRAM, "length_histogram")
    params = m.get("params", {})  # optional: what the conversion was run with
    if not isinstance(params, dict) or not isinstance(params.get("vocab_size", 0), (int, type(None))):
        raise ValueError(f"params is {params!r}, not an object with an integer vocab_size")
    files: set[str] = set()
    for split, info in m["splits"].items():
        _has(info, _SPLIT, f"splits.{split}")
        if "remainder" not in info:
            raise ValueError(f"missing key 'remainder' in splits.{split}")
        entries = [(f"splits.{split}.shards[{j}]", e) for j, e in enumerate(info["shards"])]
        if info["remainder"] is not None:
            entries.append((f"splits.{split}.remainder", info["remainder"]))
        for at, e in entries:
            _has(e, _ENTRY, at)
            if version >= TAGGED_VERSION:
                head = e.get("head_checksum", "missing")
                if not (isinstance(head, int) and 0 <= head < 1 << 32 or head is None and e["samples"] == 0):
                    raise ValueError(f"{at}.head_checksum is {head!r}, not a 32-bit checksum")
            if not _SAFE_FILE.fullmatch(e["file"]):
                raise ValueError(f"{at}.file {e['file']!r} is not a plain relative path inside the dataset")
            if e["file"] in files:
                raise ValueError(f"{at}.file {e['file']!r} is listed twice")
            files.add(e["file"])


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


def _check_schema(items: list[Any], version: int) -> None:
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


def is_local(url: str) -> bool:
    """A plain path (local or shared filesystem), not a URL or a ``pipe:`` command for webdataset's gopen."""
    return "://" not in url and not url.startswith("pipe:")


def dataset_url(root: str, relative: str) -> str:
    """Where a dataset file lives: ``root/relative`` for a directory or http(s) base, or, for a ``pipe:`` root, the
    command with ``{}`` replaced (``pipe:aws s3 cp s3://bucket/ds/{} -`` streams any file of the dataset)."""
    if root.startswith("pipe:"):
        if "{}" not in root:
            raise ManifestError(f"{root}: a pipe: dataset root needs a {{}} where the file name goes")
        return root.replace("{}", relative)
    return f"{root.rstrip('/')}/{relative}"


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Load the manifest of a dataset root: a local directory, an http(s) base URL or a ``pipe:`` command."""
    root_s = str(root)
    where = dataset_url(root_s, MANIFEST)
    if not is_local(root_s):
        import webdataset as wds

        try:
            with wds.gopen(where, "rb") as stream:
                text = stream.read().decode()
        except Exception as e:  # noqa: BLE001 - any transport failure is the same one-line error
            raise ManifestError(f"{where}: cannot read the manifest ({e})") from None
    else:
        path = Path(where)
        if not path.exists():
            raise ManifestError(f"{path}: no manifest (not a converted dataset, or its conversion did not finish)")
        text = path.read_text()
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where}: manifest is not valid JSON ({e})") from None
    try:
        _check_manifest(m)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from None
    return m
