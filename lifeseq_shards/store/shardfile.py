"""Shard files: tar members of compressed blocks, written atomically and read sequentially, and the checks a reader
makes of each member against the manifest's description of the shard (:class:`ShardFile`).

A shard is a plain ustar file of members ``NNNNNN.block.zst`` (docs/reference/format.md); any tar tool or
webdataset lists it.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from .format import Block, Field, decode_member, encode_block, expand_runs
from .writes import discard, writing

BLOCK_SUFFIX = ".block.zst"




def block_member_name(i: int) -> str:
    return f"{i:06d}{BLOCK_SUFFIX}"


def write_shard(path: Path, blocks: Iterable[Block], schema: Sequence[Field], level: int = 9) -> dict[str, Any]:
    """Write a shard atomically; returns its manifest entry (without the file name). A failed write (a full disk)
    raises :class:`~lifeseq_shards.store.writes.WriteFailed` naming it, and leaves neither it nor its temp file."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)  # decoding catches a flipped byte
    tmp = path.with_name(path.name + ".tmp")
    persons = tokens = 0
    checksums: list[int] = []
    try:
        with writing(path), open(tmp, "wb") as fh:
            for i, block in enumerate(blocks):
                data = cctx.compress(encode_block(block, schema))
                checksums.append(frame_checksum(data))
                fh.write(tar_member(block_member_name(i), data))
                persons += block.n
                tokens += int(block.columns["length"].sum(dtype=np.int64))
            fh.write(b"\0" * 1024)  # end-of-archive marker, without tarfile's padding to 10 KiB records
        os.replace(tmp, path)
    finally:
        discard(tmp)
    return {"samples": persons, "tokens": tokens, "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "head_checksum": checksums[0] if checksums else None, "block_checksums": tuple(checksums)}


def frame_checksum(frame: bytes) -> int:
    """A zstd frame's content checksum (its last 4 bytes: XXH64 of the decompressed block, low 32 bits), read, not
    computed: what identifies a block for nothing (decompressing it checks that the block is the one it names)."""
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

    A lean reader of the plain ustar files :func:`write_shard` makes (``tarfile``'s header handling cost a fifth of
    the reader's time on small shards); pax and GNU long-name headers, which it never writes, are refused rather
    than misread."""
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
    nothing (a name, a count, the block's zstd checksum against the manifest's, the schema tag in each block's
    header): a shard copied over another, one from another conversion, a block swapped in from another shard, from
    another conversion or from elsewhere in the shard, edited counts or block size, or an edited schema are
    refused at read time, not read into wrong or missing persons."""

    url: str
    samples: int
    block_persons: int
    head_checksum: int | None = None  # format 3: the first block's zstd checksum
    tag: int | None = None  # format 3: the schema tag in every block's header
    block_checksums: tuple[int, ...] | None = None  # format 4 (or upgraded): every block's zstd checksum, in order

    @property
    def blocks(self) -> int:
        return -(-self.samples // self.block_persons)

    def check_member(self, i: int, name: str, data: bytes) -> None:
        """ValueError unless member ``i`` is the block the manifest promises, under its name (and the shard's own)."""
        if i >= self.blocks:
            raise ValueError(f"more blocks than the manifest's {self.samples} persons in blocks of "
                             f"{self.block_persons} make")
        if name != block_member_name(i):
            raise ValueError(f"member {name!r} where {block_member_name(i)!r} belongs")
        want = self.head_checksum if i == 0 else None
        if self.block_checksums is not None:
            if i >= len(self.block_checksums):
                raise ValueError(f"the manifest lists {len(self.block_checksums)} block checksums, no checksum for it")
            want = self.block_checksums[i]
        if want is None or frame_checksum(data) == want:
            return
        if i == 0:
            raise ValueError("not the shard the manifest names (its first block's checksum differs: a shard copied "
                             "over it, one from another conversion, or a block swapped in)")
        raise ValueError("not the block the manifest names (its checksum differs: a block of another shard or "
                         "conversion, or another block of this shard, in its place)")

    def check_block(self, i: int, block: Block) -> None:
        """ValueError unless block ``i`` holds the persons the manifest's counts give it."""
        want = min(self.block_persons, self.samples - i * self.block_persons)
        if block.n != want:
            raise ValueError(f"{block.n} persons, where the manifest's {self.samples} persons in blocks of "
                             f"{self.block_persons} put {want}")


def read_shard_blocks(path: str | os.PathLike[str], schema: Sequence[Field]) -> Iterator[Block]:
    """Every block of a local shard file, in order, with the stamps once per token (``token_schema(schema)``)."""
    with open(path, "rb") as fh:
        for _name, data in iter_tar_members(fh):
            yield expand_runs(decode_member(data, schema), schema)
