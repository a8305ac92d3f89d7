"""Every person's length (real tokens) of a split, as the token-budget plan needs them
(:mod:`lifeseq_shards.plan.balance`), in the split's order: its shards in manifest order, then the remainder.

A dataset converted (or upgraded) since the lengths index lists, per split, a file of those lengths, raw
little-endian (``lengths/<split>.u16``: 2 bytes a person, 54 MB at 27 M persons), checked against the manifest's
byte count, person count and sha256 (as a shard file is). Without one (a dataset converted before), the lengths are
read from the blocks' ``length`` column, each block checked against the manifest as the reader checks it: the whole
split decompressed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zstandard

from .format import Field, decode_member
from .manifest import LENGTHS_DTYPES, LengthsIndex, Manifest, ManifestError
from .remote import close_file, dataset_url, open_file
from .shardfile import iter_tar_members
from .writes import discard, writing

LENGTHS_DIR = "lengths"


def split_lengths(root: str, manifest: Manifest, split: str, index: bool = True) -> tuple[np.ndarray, list[int]]:
    """(length of each person of ``split`` as int64, in the split's order; the persons of each of its shards in
    manifest order, then of the remainder shard). ``root``: the dataset's directory, http(s) base or ``pipe:``
    command. ``index``: read the split's lengths index when the manifest lists one (False: decode the blocks even
    then, what the index is compared with). ManifestError, one line naming the file, when the index or a shard cannot
    be read, is not the one the manifest names (size, count, checksum), or the counts disagree."""
    if split not in manifest.splits:
        raise ManifestError(f"{root}: no split {split!r} (has {', '.join(manifest.splits)})")
    info = manifest.splits[split]
    sizes = [e.samples for e in info.entries()]
    if index and info.lengths is not None:
        url = dataset_url(str(root), info.lengths.file)
        try:
            stream = open_file(url)
            try:
                data = stream.read()
            finally:
                failure = close_file(stream)
        except OSError as e:  # a missing local file, a stalled transfer: not the index the manifest names
            raise ManifestError(f"{url}: cannot read the lengths index ({e.strerror or e})") from None
        if failure:
            raise ManifestError(f"{url}: cannot read the lengths index{failure}")
        try:
            return index_lengths(data, info.lengths, sum(sizes)).astype(np.int64), sizes
        except ValueError as e:
            raise ManifestError(f"{url}: {e}") from None
    return _block_lengths(root, manifest, split), sizes


def index_lengths(data: bytes, index: LengthsIndex, persons: int) -> np.ndarray:
    """The lengths in ``data``, the bytes of ``index``'s file (a view, in the index's dtype); ValueError, saying
    what differs, unless the index holds ``persons`` (the split's shards' count) and ``data`` are the bytes the
    manifest describes (size, sha256)."""
    if index.persons != persons:
        raise ValueError(f"the lengths index lists {index.persons} persons, the split's shards {persons}")
    if len(data) != index.bytes:
        raise ValueError(f"lengths index of {len(data)} bytes, the manifest lists {index.bytes} ({index.persons} "
                         f"persons of {index.dtype}): truncated or another file")
    if hashlib.sha256(data).hexdigest() != index.sha256:
        raise ValueError("lengths index's sha256 differs from the manifest's (damaged, or another dataset's)")
    return np.frombuffer(data, dtype=np.dtype(index.dtype).newbyteorder("<"))


def index_dtype(schema: Sequence[Field]) -> str:
    """The narrowest of uint16, uint32, uint64 that holds every value the schema's ``length`` dtype can: decided
    from the schema, so that every conversion with the same options writes the same kind of index."""
    length = np.iinfo(next(f.dtype for f in schema if f.name == "length"))
    return next(d for d in LENGTHS_DTYPES if np.iinfo(d).max >= length.max)


def write_lengths_index(root: Path, split: str, lengths: np.ndarray, schema: Sequence[Field]) -> LengthsIndex:
    """Write ``lengths`` (the split's, in its order) as ``root/lengths/<split>.u16`` (or .u32, .u64:
    :func:`index_dtype`), through a temp file renamed into place; returns its manifest entry. A failed write raises
    :class:`~lifeseq_shards.store.writes.WriteFailed` naming it, and leaves no temp file. The caller writes the
    manifest after it."""
    dtype = index_dtype(schema)
    file = f"{LENGTHS_DIR}/{split}.u{np.dtype(dtype).itemsize * 8}"
    path = root / file
    data = np.ascontiguousarray(lengths, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
    finally:
        discard(tmp)
    return LengthsIndex(file, dtype, len(lengths), len(data), hashlib.sha256(data).hexdigest())


def _block_lengths(root: str, manifest: Manifest, split: str) -> np.ndarray:
    """The split's lengths read from its blocks' ``length`` column (every block decompressed and checked)."""
    parts = []
    for entry in manifest.splits[split].entries():
        url = dataset_url(str(root), entry.file)
        shard = manifest.shard_file(entry, url)
        stream = open_file(url)
        got = 0
        try:
            for i, (name, data) in enumerate(iter_tar_members(stream)):
                shard.check_member(i, name, data)
                block = decode_member(data, manifest.schema, manifest.tag)
                shard.check_block(i, block)
                parts.append(np.asarray(block.columns["length"], dtype=np.int64))
                got += block.n
        except (OSError, ValueError, zstandard.ZstdError) as e:  # a damaged shard: say which, in one line
            raise ManifestError(f"{url}: {e}") from None
        finally:
            failure = close_file(stream)
        if failure or got != entry.samples:
            raise ManifestError(f"{url}: {got} persons read where the manifest lists {entry.samples}{failure}")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
