"""The reader's pipeline stages, each a small generator taking what it needs (the plan's inputs, the shard files,
a :class:`BatchSpec`), composed by ``ShardedDataset.__iter__`` in a ``webdataset.DataPipeline``:

``slot_windows`` (the windows, or pieces of windows, holding the persons this rank+worker reads this pass, in the
order it reads them: the epoch plan's :class:`~lifeseq_shards.plan.epoch.WorkerRead`; no I/O)
-> ``load_windows`` (stream the needed tar members, opened at the I/O edge (:mod:`lifeseq_shards.store.remote`): a
local or shared filesystem, http(s), or a ``pipe:`` command; decode only the blocks needed)
-> ``sized_batches`` (gather each batch's persons, as many as the plan says, in narrow dtypes: padded, or packed
into one buffer of real tokens)
-> ``messages`` (in DataLoader workers: a few batches per item, packed buffers moved into the worker's ring).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import zstandard

from ..device.batch import HostBatch, PackedBatch
from ..plan.epoch import Ordered, WorkerRead
from ..plan.order import Window
from ..plan.slots import Segment
from ..store.format import SCALAR, Block, Field, concat_blocks, decode_member
from ..store.remote import close_file, open_file
from ..store.shardfile import ShardFile, iter_tar_members
from .collate import BatchSpec, collate
from .transport import RingWriter


def slot_windows(read: WorkerRead) -> Iterator[Ordered]:
    """Stage 1: the windows of a worker's ``read`` that hold its batches, each with its order, from person
    ``read.first`` of its stream on (a resumed pass may start inside the first window)."""
    for win, order in read.windows():
        yield win, order[max(read.first - win.start, 0):]


SHARD_FIELD = Field("shard", "int32", SCALAR)  # a person's shard, when the dataset is asked for it (predict)


def with_shard_field(schema: Sequence[Field]) -> tuple[Field, ...]:
    """The batches' schema when each person carries its shard (:data:`SHARD_FIELD`)."""
    return (*schema, SHARD_FIELD)


def load_windows(src: Iterator[Ordered], shards: Sequence[ShardFile], schema: Sequence[Field],
                 shard_ids: Sequence[int] | None = None) -> Iterator[tuple[Window, np.ndarray, Block]]:
    """Stage 2: read each window's persons (only the blocks it needs are decompressed), joined in one copy. With
    ``shard_ids`` (one per shard file) each person gets its shard's id in a :data:`SHARD_FIELD` column."""
    out_schema = schema if shard_ids is None else with_shard_field(schema)
    for win, order in src:
        parts = []
        for s in win.segments:
            blocks = read_segment(Segment(shards[s.shard], s.start, s.stop), schema)
            if shard_ids is not None:
                for b in blocks:
                    b.columns[SHARD_FIELD.name] = np.full(b.n, shard_ids[s.shard], dtype=SHARD_FIELD.dtype)
            parts += blocks
        yield win, order, concat_blocks(parts, out_schema) if len(parts) != 1 else parts[0]


def read_segment(segment: Segment[ShardFile], schema: Sequence[Field]) -> list[Block]:
    """The blocks holding persons [start, stop) of one shard file (``segment``), decoded by ``schema`` and each cut
    to that range (views, no copy). Every member met is checked against the manifest (:class:`ShardFile`), and a
    read of the shard's last block makes sure that none follows it: a shard that is not the manifest's, or holds
    other counts, fails here, naming it."""
    shard, bp = segment.shard, segment.shard.block_persons
    first, last = segment.start // bp, (segment.stop - 1) // bp
    blocks = []
    i = 0  # the member being read
    stream = open_file(shard.url)
    try:
        for name, data in iter_tar_members(stream):
            shard.check_member(i, name, data)
            if i >= first:
                block = decode_member(data, schema, shard.tag)
                shard.check_block(i, block)
                blocks.append(block.slice(max(segment.start - i * bp, 0), min(segment.stop - i * bp, block.n),
                                          schema))
                if i == last < shard.blocks - 1:
                    break
            i += 1
    except (OSError, ValueError, zstandard.ZstdError) as e:  # a damaged shard: say which one, in one line
        raise OSError(f"{shard.url}: block {i}: {e}") from None
    finally:
        # a read that stops at the blocks it needs closes a command before its end, by our doing: every block read
        # is checked, and a read that lacks one fails below, naming the shard
        failed = close_file(stream)
    if len(blocks) != last - first + 1:
        raise OSError(f"{shard.url}: ended after {first + len(blocks)} blocks, needed {last + 1}{failed}")
    return blocks


def sized_batches(src: Iterator[tuple[Window, np.ndarray, Block]], spec: BatchSpec, sizes: Iterable[int],
                  drop_last: bool = False) -> Iterator[HostBatch]:
    """Stage 3: cut a stream of persons (each item: a window, the indices of its ``block``'s persons in the order
    they are yielded, and the block) into batches of ``sizes`` persons, in turn, and
    collate them: one gather per batch from its block (a batch that spans two blocks joins its two parts), so the
    cost is linear in the persons read. A last batch the stream leaves short is yielded unless ``drop_last``."""
    schema = spec.schema
    sizes = iter(sizes)
    size = next(sizes, None)
    carry: Block | None = None
    for _, order, block in src:
        i = 0
        if carry is not None and size is not None:
            i = min(size - carry.n, len(order))
            carry = concat_blocks([carry, block.take(order[:i], schema)], schema)
            if carry.n < size:
                continue
            yield collate(carry, spec)
            carry, size = None, next(sizes, None)
        while size is not None and i + size <= len(order):
            yield collate(block, spec, order[i : i + size])
            i, size = i + size, next(sizes, None)
        if i < len(order) and size is not None:
            carry = block.take(order[i:], schema)
    if carry is not None and not drop_last:
        yield collate(carry, spec)


def messages(src: Iterator[HostBatch], per_message: int, first: int,
             writer: RingWriter | None = None) -> Iterator[list[HostBatch]]:
    """Stage 4 (DataLoader workers): lists of ``per_message`` batches, cut at multiples of it in the worker's own
    batch numbering (batch ``first`` is the first one read), so that a resumed pass sends the same messages as an
    uninterrupted one from its first whole message on. With a ``writer``, a complete message's packed buffers go
    into the worker's ring and ring entries (``RingEntry``) take their place: the pipe then carries a few hundred
    bytes per batch. A message too large for the ring keeps its buffers and travels through the pipe."""
    def send(group: list[HostBatch]) -> list[HostBatch]:
        packed = [b for b in group if isinstance(b, PackedBatch)] if writer is not None else []
        if writer is not None and len(packed) == len(group) and writer.fits(sum(b.buffer.nbytes for b in packed)):
            return [b.with_buffer(writer.put(b.buffer)) for b in packed]
        return group

    group: list[HostBatch] = []
    for b, batch in enumerate(src, start=first):
        group.append(batch)
        if (b + 1) % per_message == 0:
            yield send(group)
            group = []
    if group:
        yield send(group)

