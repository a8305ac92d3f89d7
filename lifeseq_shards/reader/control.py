"""The epoch control: where the dataset's next pass starts, where persistent DataLoader workers see it.

A persistent worker keeps the dataset it was started with, so a new epoch or resume point reaches it through memory
the two processes share: the position as a checkpoint writes it (its keys in the loader state,
:func:`~lifeseq_shards.reader.state.position_text`), its length first, in a shared byte tensor, and the passes each
worker began since, in a shared counter each. Shared tensors, not files: a killed job leaves nothing in /dev/shm.
The bytes' room is fixed when the workers start (they keep the tensor they were given); a position that does not fit
(:data:`POSITION_BYTES`: about 100,000 persons owed, or thousands of legs) is refused in one line, naming it.
"""

from __future__ import annotations

import torch

from ..plan.resume import Position
from .state import position_of, position_text

POSITION_BYTES = 1 << 20  # the room for a position's text: each worker maps it, so it is fixed, and 1 MiB a dataset
_LENGTH = 8  # the text's length, first, as an int64


class EpochControl:
    """The epoch and the resume point of the next pass (:meth:`set_epoch`, :meth:`loaded`), and the passes each
    worker began since then (a worker's n-th pass is the n-th after the loaded position:
    :meth:`~lifeseq_shards.plan.epoch.EpochPlan.pass_position`). ``room``: the bytes a position's text may take."""

    def __init__(self, num_workers: int, room: int = POSITION_BYTES) -> None:
        self._passes = torch.zeros(max(1, num_workers), dtype=torch.int64).share_memory_()
        self._bytes = torch.zeros(_LENGTH + room, dtype=torch.uint8).share_memory_()
        self.set_epoch(Position(0, 0))

    @property
    def room(self) -> int:
        return len(self._bytes) - _LENGTH

    def set_epoch(self, at: Position) -> None:
        """The next pass starts at ``at``; every worker's passes count from it. ValueError when its text does not
        fit in :attr:`room`."""
        text = position_text(at).encode()
        if len(text) > self.room:
            raise ValueError(f"epoch {at.epoch}'s position ({len(at.history)} legs, {len(at.left_out_before)} "
                             f"persons owed) takes {len(text):,} bytes, more than the {self.room:,} the workers share "
                             "(reader/control.py POSITION_BYTES); resume in the checkpoint's arrangement, or start the "
                             "epoch over")
        self._bytes[_LENGTH : _LENGTH + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self._bytes[:_LENGTH] = torch.tensor([len(text)], dtype=torch.int64).view(torch.uint8)
        self._passes.zero_()

    def loaded(self) -> Position:
        """Where the first pass since :meth:`set_epoch` starts."""
        n = int(self._bytes[:_LENGTH].view(torch.int64)[0])
        return position_of(bytes(self._bytes[_LENGTH : _LENGTH + n].numpy()).decode())

    def passes(self, worker: int = 0) -> int:
        """The passes ``worker`` started since :meth:`set_epoch`."""
        return int(self._passes[worker])

    def claim_pass(self, worker: int) -> int:
        """:meth:`passes`, and count the pass as started."""
        n = self.passes(worker)
        self._passes[worker] += 1
        return n
