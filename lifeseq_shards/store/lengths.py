"""Every person's length (real tokens) of a split, as the token-budget plan needs them
(:mod:`lifeseq_shards.plan.balance`): read from the blocks' ``length`` column, each block checked against the
manifest as the reader checks it. The manifest itself holds only each shard's token total and a histogram, so this
decompresses the whole split (a lengths index per shard would make it a read of 2 bytes a person; not in the format
yet)."""

from __future__ import annotations

import numpy as np
import zstandard

from .format import decode_member
from .manifest import Manifest, ManifestError
from .remote import close_file, dataset_url, open_file
from .shardfile import iter_tar_members


def split_lengths(root: str, manifest: Manifest, split: str) -> tuple[np.ndarray, list[int]]:
    """(length of each person of ``split``, shards in manifest order then the remainder shard; the persons of each
    of those shards). ManifestError naming the shard when it cannot be read, a block is not the one the manifest
    names, or the counts disagree."""
    if split not in manifest.splits:
        raise ManifestError(f"{root}: no split {split!r} (has {', '.join(manifest.splits)})")
    parts, sizes = [], []
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
        sizes.append(entry.samples)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), sizes
