"""Where the converter puts persons: temp bucket files of compressed blocks (pass 1) and, cut from them, the shard
files of a split (pass 2)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from ..store.format import Block, Field, concat_blocks, decode_block, encode_block
from ..store.lengths import index_dtype, write_lengths_index
from ..store.manifest import ShardEntry, Split
from ..store.shardfile import write_shard
from ..store.writes import WriteFailed, writing

REMAINDER = "remainder.tar"

class Spill:
    """Append-only temp files, one per bucket, of length-prefixed zstd blocks."""

    def __init__(self, root: Path, buckets: int, schema: Sequence[Field]):
        self.paths = [root / f"bucket-{b:05d}.bin" for b in range(buckets)]
        self.files = []
        with writing(root):
            for p in self.paths:
                self.files.append(open(p, "wb"))  # noqa: SIM115 - open until close(), one per bucket
        self.schema = schema
        self.cctx = zstandard.ZstdCompressor(level=1)

    def add(self, bucket: int, block: Block) -> None:
        data = self.cctx.compress(encode_block(block, self.schema))
        with writing(self.paths[bucket]):
            self.files[bucket].write(struct.pack("<Q", len(data)) + data)

    def close(self) -> None:
        """Close every bucket file (each flushes, which may fail too); a failure is raised once all are closed."""
        failed: WriteFailed | None = None
        for path, fh in zip(self.paths, self.files, strict=False):
            try:
                with writing(path):
                    fh.close()
            except WriteFailed as e:
                failed = failed or e
        if failed:
            raise failed

    def read(self, bucket: int) -> list[Block]:
        dctx = zstandard.ZstdDecompressor()
        out, raw = [], self.paths[bucket].read_bytes()
        pos = 0
        while pos < len(raw):
            (size,) = struct.unpack_from("<Q", raw, pos)
            out.append(decode_block(dctx.decompress(raw[pos + 8 : pos + 8 + size]), self.schema))
            pos += 8 + size
        return out


@dataclass
class SplitWriter:
    """Cuts a split's person stream into shards of exactly ``per_shard`` persons; the tail is the remainder. It writes
    the shards ``first`` .. ``stop - 1`` of the ``shards`` (and the remainder when ``remainder``): the persons of the
    stream outside them are passed over (an array task's share, convert/array.py; all of them otherwise)."""

    name: str
    out: Path
    shards: int
    per_shard: int
    schema: Sequence[Field]
    block_persons: int
    zstd_level: int
    pool: ProcessPoolExecutor | None  # None: write in this process
    inflight: int = 2  # shards the pool may hold at once (each holds its persons in memory)
    first: int = 0
    stop: int = -1  # -1: every shard
    remainder: bool = True
    persons: int = 0  # the split's persons, the stream's length
    seen: int = 0  # persons of the stream added or skipped so far
    pending: list[Block] = field(default_factory=list)
    pending_n: int = 0
    written: int = 0
    futures: list[tuple[str, Future[dict[str, Any]] | dict[str, Any]]] = field(default_factory=list)  # name: stats
    # each shard's lengths in the order submitted (the split's order), for its lengths index: copies in the index's
    # dtype (2 bytes a person), not views that would keep every shard's block alive
    lengths: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stop < 0:
            self.stop = self.shards

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the stream this writer writes."""
        end = self.persons if self.remainder else self.stop * self.per_shard
        return self.first * self.per_shard, end

    def wants(self, n: int) -> bool:
        """Whether the stream's next ``n`` persons hold any this writer writes."""
        start, end = self.span
        return n > 0 and self.seen < end and self.seen + n > start

    def skip(self, n: int) -> None:
        """Pass over the stream's next ``n`` persons, none of which this writer writes (:meth:`wants` said so)."""
        if self.wants(n):
            raise RuntimeError(f"{self.name}: skipped persons {self.seen}..{self.seen + n} of its shards")
        self.seen += n

    def add(self, block: Block) -> None:
        start, end = self.span
        lo, hi = min(max(start - self.seen, 0), block.n), min(max(end - self.seen, 0), block.n)
        self.seen += block.n
        if lo or hi < block.n:
            block = block.slice(lo, hi, self.schema)
        self.pending.append(block)
        self.pending_n += block.n
        if self.first + self.written >= self.stop or self.pending_n < self.per_shard:
            return
        merged, start = concat_blocks(self.pending, self.schema), 0
        while self.first + self.written < self.stop and merged.n - start >= self.per_shard:
            self._submit(f"shard-{self.first + self.written:06d}.tar",
                         merged.slice(start, start + self.per_shard, self.schema))
            start += self.per_shard
            self.written += 1
        rest = merged.slice(start, merged.n, self.schema)
        self.pending, self.pending_n = [rest], rest.n

    def finish(self) -> None:
        if self.first + self.written != self.stop:
            raise RuntimeError(f"{self.name}: wrote {self.written} of shards {self.first}..{self.stop - 1}")
        if self.pending_n and self.remainder:
            self._submit(REMAINDER, concat_blocks(self.pending, self.schema))
        elif self.pending_n:
            raise RuntimeError(f"{self.name}: {self.pending_n} persons past shard {self.stop - 1}")
        self.pending, self.pending_n = [], 0

    def _submit(self, name: str, block: Block) -> None:
        self.lengths.append(block.columns["length"].astype(index_dtype(self.schema)))
        args = (self.out / self.name / name, block, self.schema, self.block_persons, self.zstd_level)
        if self.pool is None:
            self.futures.append((name, _write_shard_job(args)))
            return
        _bounded(self.futures, self.inflight)
        self.futures.append((name, self.pool.submit(_write_shard_job, args)))

    def split(self) -> Split:
        """The split's manifest entry (of the shards this writer wrote), once they are written; writes their lengths
        index (from the lengths the shards were written with: no pass over them)."""
        done = [(n, ShardEntry(file=f"{self.name}/{n}", **(f.result() if isinstance(f, Future) else f)))
                for n, f in self.futures]
        rem = [e for n, e in done if n == REMAINDER]
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=index_dtype(self.schema))
        index = write_lengths_index(self.out, self.name, lengths, self.schema)
        return Split(self.persons, self.per_shard, tuple(e for n, e in done if n != REMAINDER), rem[0] if rem else None,
                     index)


def _bounded(futures: list[tuple[str, Any]], limit: int) -> None:
    live = [f for _, f in futures if isinstance(f, Future) and not f.done()]
    if len(live) >= limit:
        wait(live, return_when=FIRST_COMPLETED)


def _write_shard_job(args: tuple[Path, Block, Sequence[Field], int, int]) -> dict[str, Any]:
    path, block, schema, per_block, level = args
    blocks = (block.slice(s, min(s + per_block, block.n), schema) for s in range(0, block.n, per_block))
    return write_shard(path, blocks, schema, level)
