"""The on-disk format: the field schema and the columnar block codec (shard files: shardfile.py; the manifest:
manifest.py).

A shard is a plain tar file. Each member ``NNNNNN.block.zst`` holds a *block* of persons, zstd-compressed, in a
columnar format that ``np.frombuffer`` reads without parsing (docs/reference/format.md gives it byte for byte).
Persons are never one tar member each: a tar header and an ``np.load`` per person make that format slow and large
(docs/results/reader.md, "Layouts").
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import zstandard

FORMAT_VERSION = 4
# format 1 stored the stamps once per token; format 2 had neither the blocks' schema tag nor the shards' head_checksum;
# format 3 had no checksum of the blocks after the first (`shardify upgrade` adds them to any format)
READABLE_VERSIONS = (1, 2, 3, 4)
TAGGED_VERSION = 3
CHECKSUMMED_VERSION = 4
MAGIC = b"LSB1"
# default smallest shard: 4 blocks of 256, so a shard's file open, tar headers and short last block cost little per
# person
MIN_SHARD_PERSONS = 1024
ALIGN = 8

# kind: "scalar" = one value per person; "ragged" = `length` values per person; "targets" = `n_targets` values;
# "runs" = `n_runs` values: the stamps once per run of tokens that share them (an event's tokens do), with the run's
# `run_length` in tokens: fewer bytes to decompress than a stamp per token.
SCALAR, RAGGED, TARGETS, RUNS = "scalar", "ragged", "targets", "runs"
COUNT_OF = {RAGGED: "length", TARGETS: "n_targets", RUNS: "n_runs"}
RUN_LENGTH = "run_length"
STAMPS = ("abspos", "age", "segment")
# the special tokens, at ids 0-4 of every vocabulary (the converter refuses a vocab.csv that has them elsewhere; the
# padding, the masker and the seed's step 5 take these ids, not the file's)
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")
PAD, CLS, SEP, MASK, UNK = range(len(SPECIAL_TOKENS))


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


def token_schema(schema: Sequence[Field]) -> list[Field]:
    """The schema with the stamps once per token (format 1's layout): what sources produce and padded batches hold."""
    return [Field(f.name, f.dtype, RAGGED if f.kind == RUNS else f.kind) for f in schema
            if f.name not in ("n_runs", RUN_LENGTH)]


def schema_json(schema: Sequence[Field]) -> bytes:
    """The schema's canonical JSON: what the fingerprint and the blocks' schema tag are computed from."""
    return json.dumps([f.to_json() for f in schema], sort_keys=True).encode()


def schema_tag(schema: Sequence[Field]) -> int:
    """The 32-bit tag every format-3 block carries in its header: a block decoded with another schema (fields
    swapped or renamed in the manifest) is refused instead of read into the wrong fields."""
    return _tag_of(tuple(schema))


@functools.cache
def _tag_of(schema: tuple[Field, ...]) -> int:
    # every block encoded asks for its schema's tag: a few schemas per process, computed once each
    return zlib.crc32(schema_json(schema))


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


def ragged_counts(schema: Sequence[Field]) -> set[str]:
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

    def slice(self, start: int, stop: int, schema: Sequence[Field]) -> Block:
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

    def take(self, index: np.ndarray, schema: Sequence[Field]) -> Block:
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


def concat_blocks(blocks: list[Block], schema: Sequence[Field]) -> Block:
    return Block({f.name: np.concatenate([b.columns[f.name] for b in blocks]) for f in schema})


def _run_fields(schema: Sequence[Field]) -> list[str]:
    """The fields stored once per run (none in format 1)."""
    return [f.name for f in schema if f.kind == RUNS and f.name != RUN_LENGTH]


def to_runs(block: Block, schema: Sequence[Field]) -> Block:
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


def expand_runs(block: Block, schema: Sequence[Field]) -> Block:
    """The block with every stamp once per token again (``token_schema(schema)``'s format)."""
    runs = _run_fields(schema)
    if not runs:
        return block
    reps = block.columns[RUN_LENGTH]
    return Block({f.name: np.repeat(block.columns[f.name], reps) if f.name in runs else block.columns[f.name]
                  for f in token_schema(schema)})


def encode_block(block: Block, schema: Sequence[Field]) -> bytes:
    """Raw (uncompressed) block payload: MAGIC, uint32 n, uint32 schema tag, then each field's values, 8-byte
    aligned."""
    parts = [MAGIC, struct.pack("<II", block.n, schema_tag(schema))]
    for f in schema:
        raw = np.ascontiguousarray(block.columns[f.name], dtype=np.dtype(f.dtype).newbyteorder("<")).tobytes()
        parts.append(raw)
        if len(raw) % ALIGN:
            parts.append(b"\0" * (ALIGN - len(raw) % ALIGN))
    return b"".join(parts)


def decode_block(payload: bytes | memoryview, schema: Sequence[Field], tag: int | None = None) -> Block:
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


def decode_member(data: bytes, schema: Sequence[Field], tag: int | None = None) -> Block:
    return decode_block(decompress(data), schema, tag)

