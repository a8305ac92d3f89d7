"""The workers' rings from both sides in one process (lifeseq_shards/reader/transport.py): a RingWriter waits for the
RingReader to release bytes before it overwrites them, the reader's copies are the batches' own bytes, and a new
iteration of the loader frees a writer of an older one. The loader's own runs of them are in
tests/reader/test_reader.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lifeseq_shards.reader.transport import RingEntry, RingReader, RingWriter

RING = 64


def batch(value: int, nbytes: int = 24) -> np.ndarray:
    return np.full(nbytes, value, dtype=np.uint8)


def put_in_thread(writer: RingWriter, buf: np.ndarray) -> tuple[threading.Thread, list[RingEntry]]:
    entries: list[RingEntry] = []
    thread = threading.Thread(target=lambda: entries.append(writer.put(buf)), daemon=True)
    thread.start()
    return thread, entries


@pytest.mark.timeout(30)
def test_the_writer_waits_for_the_reader_and_the_copies_are_the_batches() -> None:
    reader = RingReader(1, RING)
    writer = RingWriter(reader.rings, reader.ctl, 0)
    writer.new_pass()
    first, second = writer.put(batch(1)), writer.put(batch(2))
    assert (first.offset, second.offset) == (0, 24)
    thread, third = put_in_thread(writer, batch(3))  # does not fit before the end: offset 0, over the first batch
    thread.join(0.3)
    assert thread.is_alive() and not third, "the writer overwrote a batch the reader had not copied"
    got = reader.take(first, pin_memory=False)
    thread.join(10)
    assert not thread.is_alive() and third[0].offset == 0 and third[0].end == RING + 24
    # the copy taken before the writer went over its bytes is the first batch's own
    assert got.numpy().tobytes() == batch(1).tobytes()
    assert reader.take(second, pin_memory=False).numpy().tobytes() == batch(2).tobytes()
    assert reader.take(third[0], pin_memory=False).numpy().tobytes() == batch(3).tobytes()
    assert int(reader.ctl[1]) == third[0].end  # every byte released


@pytest.mark.timeout(30)
def test_a_new_iteration_frees_a_writer_of_an_older_one() -> None:
    reader = RingReader(2, RING)
    iteration = reader.begin()
    writer = RingWriter(reader.rings, reader.ctl, 1)
    writer.new_pass()
    writer.put(batch(1, 40))
    thread, entries = put_in_thread(writer, batch(2, 40))  # waits: the reader never copies the first
    thread.join(0.3)
    assert thread.is_alive()
    newer = reader.begin()  # the loader's next iteration: nobody reads the older pass's batches
    thread.join(10)
    assert not thread.is_alive() and entries
    reader.end(iteration)  # the older iteration ends after the newer one began: the newer one keeps its number
    assert int(reader.ctl[0]) == newer
    reader.end(newer)
    assert int(reader.ctl[0]) == newer + 1
    assert int(reader.ctl[1]) == int(reader.ctl[2]) == 0  # nothing copied, nothing released
