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
import struct
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # format 1 stored the stamps once per token
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


def token_schema(schema: list[Field]) -> list[Field]:
    """The schema with the stamps once per token (format 1's layout): what sources produce and padded batches hold."""
    return [Field(f.name, f.dtype, RAGGED if f.kind == RUNS else f.kind) for f in schema
            if f.name not in ("n_runs", RUN_LENGTH)]


def schema_from_json(items: list[dict[str, str]]) -> list[Field]:
    return [Field(i["name"], i["dtype"], i["kind"]) for i in items]


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
    """Raw (uncompressed) block payload: MAGIC, uint32 n, uint32 0, then each field's values, 8-byte aligned."""
    parts = [MAGIC, struct.pack("<II", block.n, 0)]
    for f in schema:
        raw = np.ascontiguousarray(block.columns[f.name], dtype=np.dtype(f.dtype).newbyteorder("<")).tobytes()
        parts.append(raw)
        if len(raw) % ALIGN:
            parts.append(b"\0" * (ALIGN - len(raw) % ALIGN))
    return b"".join(parts)


def decode_block(payload: bytes | memoryview, schema: list[Field]) -> Block:
    """Inverse of :func:`encode_block`: zero-copy views into ``payload``."""
    if bytes(payload[:4]) != MAGIC:
        raise ValueError("not a lifeseq block (bad magic)")
    (n, _) = struct.unpack_from("<II", payload, 4)
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


def decode_member(data: bytes, schema: list[Field]) -> Block:
    return decode_block(decompress(data), schema)


# ---------------------------------------------------------------------------------------------------------------
# Shards: tar files of blocks, written to a temp name and renamed when complete.


def block_member_name(i: int) -> str:
    return f"{i:06d}{BLOCK_SUFFIX}"


def write_shard(path: Path, blocks: Iterable[Block], schema: list[Field], level: int = 9) -> dict[str, Any]:
    """Write a shard atomically; returns its manifest entry (without the file name)."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)  # decoding catches a flipped byte
    tmp = path.with_name(path.name + ".tmp")
    persons = tokens = 0
    with open(tmp, "wb") as fh:
        for i, block in enumerate(blocks):
            fh.write(tar_member(block_member_name(i), cctx.compress(encode_block(block, schema))))
            persons += block.n
            tokens += int(block.columns["length"].sum(dtype=np.int64))
        fh.write(b"\0" * 1024)  # end-of-archive marker, without tarfile's padding to 10 KiB records
    os.replace(tmp, path)
    return {"samples": persons, "tokens": tokens, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


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


def read_shard_blocks(path: str | os.PathLike[str], schema: list[Field]) -> Iterator[Block]:
    """Every block of a local shard file, in order, with the stamps once per token (``token_schema(schema)``)."""
    with open(path, "rb") as fh:
        for _name, data in iter_tar_members(fh):
            yield expand_runs(decode_member(data, schema), schema)


# ---------------------------------------------------------------------------------------------------------------
# Manifest


def fingerprint(schema: list[Field], shard_hashes: Iterable[str]) -> str:
    h = hashlib.sha256(json.dumps([f.to_json() for f in schema], sort_keys=True).encode())
    for s in shard_hashes:
        h.update(s.encode())
    return h.hexdigest()[:32]


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Written last, atomically: a directory without manifest.json is not a dataset."""
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False))
    os.replace(tmp, out / MANIFEST)


class ManifestError(ValueError):
    pass


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
    if m.get("format_version") not in READABLE_VERSIONS:
        raise ManifestError(f"{where}: format version {m.get('format_version')} (this reader reads "
                            f"{', '.join(map(str, READABLE_VERSIONS))})")
    return m
