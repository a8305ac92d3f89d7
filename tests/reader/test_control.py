"""The epoch control (lifeseq_shards/reader/control.py) reaches a persistent DataLoader worker with a position far
larger than the int64 tensor it replaced held (32 legs, 8,192 persons: both were refused), and refuses one past
its room in one line, naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch.utils.data import DataLoader, IterableDataset

from lifeseq_shards.plan.resume import Arrangement, Leg, Position
from lifeseq_shards.reader.control import EpochControl
from lifeseq_shards.reader.state import position_text


class Passes(IterableDataset):
    """Each pass yields where it starts and the pass's number, as a worker reads them from the control."""

    def __init__(self) -> None:
        super().__init__()
        self.control = EpochControl(1)

    def __iter__(self) -> Iterator[tuple[Position, int]]:
        n = self.control.claim_pass(0)
        yield self.control.loaded(), n


def big_position(epoch: int) -> Position:
    """A position far past the old caps: 40 legs (ranks 1..40, budgets and batches of persons) and 20,000
    persons owed."""
    legs = tuple(Leg(Arrangement(r, r % 3, 8 + r, bool(r % 2), 4096, 1 + r % 4, 0 if r % 5 else 1000 * r), 7 * r)
                   for r in range(1, 41))
    return Position(epoch, 123, legs, tuple(range(5, 100_005, 5)))


@pytest.mark.timeout(120)
def test_a_persistent_worker_reads_a_position_past_the_old_caps() -> None:
    ds = Passes()
    loader = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True, collate_fn=lambda b: b)
    ds.control.set_epoch(Position(3, 0))
    assert list(loader) == [(Position(3, 0), 0)]
    assert list(loader) == [(Position(3, 0), 1)]  # the same worker: its second pass since set_epoch
    big = big_position(4)
    assert len(big.history) > 32 and len(big.left_out_before) > 8192
    ds.control.set_epoch(big)  # after the worker started: it sees it in the memory it shares
    assert list(loader) == [(big, 0)]
    assert ds.control.passes(0) == 1
    ds.control.set_epoch(Position(5, 0))  # a shorter one after it: none of the longer one's bytes is read
    assert list(loader) == [(Position(5, 0), 0)]


def test_a_position_past_the_room_is_refused_naming_it() -> None:
    big = big_position(2)
    size = len(position_text(big).encode())
    fits = EpochControl(0, room=size)
    fits.set_epoch(big)
    assert fits.loaded() == big
    short = EpochControl(0, room=size - 1)
    with pytest.raises(ValueError, match=rf"epoch 2's position \(40 legs, 20000 persons owed\) takes {size:,} "
                                         rf"bytes, more than the {size - 1:,} the workers share \(reader/control.py "
                                         r"POSITION_BYTES\)"):
        short.set_epoch(big)
    assert short.loaded() == Position(0, 0)  # refused whole: the position before stays
