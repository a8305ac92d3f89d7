"""Index arithmetic between a batch's two layouts: packed (each person's values concatenated, ``counts`` of them per
person) and padded (B, width). Shared by the batch built on the device (:mod:`lifeseq_shards.device.build`) and the
encoder's padding-free attention (:mod:`lifeseq_shards.model`), so the two cannot disagree on where a token goes.

Gathers only, sizes known on the host: no boolean indexing, which would sync to learn its size.
"""

from __future__ import annotations

import torch


def starts(counts: torch.Tensor) -> torch.Tensor:
    """Where each person's values begin in the concatenation."""
    return torch.cumsum(counts, 0) - counts


def padded_rows(counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) positions in the concatenation of each padded cell's value, and which cells hold a real one (the
    others point past their person: clamp before gathering)."""
    col = torch.arange(width, device=counts.device)
    return starts(counts)[:, None] + col[None, :], col[None, :] < counts[:, None]


def packed_cells(counts: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """(n,) for each of the concatenation's first ``n`` values, its cell in the flattened (B * width) padded array;
    ``n`` is ``counts.sum()``, known on the host."""
    person = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=n)
    return person * width + torch.arange(n, device=counts.device) - starts(counts)[person]
