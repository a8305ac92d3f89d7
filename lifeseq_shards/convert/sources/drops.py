"""Why a source drops an input row. A source block's ``drop_reason`` column gives each input row's code (0: kept);
the manifest counts the dropped rows by reason name (``totals.dropped``); ``summary`` says it in words."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

MIN_EVENTS = 5  # the seed's step 5 keeps a person with at least this many events in the time range
KEPT, TOO_FEW_EVENTS = 0, 1
# code -> (the manifest's name, what it means)
REASONS = {TOO_FEW_EVENTS: ("too_few_events", f"fewer than {MIN_EVENTS} events in the time range")}
DROP_REASON = "drop_reason"  # the source block's column


def counts(codes: np.ndarray) -> dict[str, int]:
    """Dropped rows by reason name (every reason, 0 where none)."""
    found = np.bincount(codes.astype(np.int64), minlength=max(REASONS) + 1)
    return {name: int(found[code]) for code, (name, _) in REASONS.items()}


def summary(dropped: Mapping[str, int] | None, rows: int | None) -> str:
    """'dropped 155 of 6,000 input rows: 155 with fewer than 5 events in the time range' (or why it cannot say)."""
    if dropped is None:
        return "dropped input rows not counted (converted before the manifest recorded them)"
    of = "" if rows is None else f" of {rows:,}"
    total = sum(dropped.values())
    if not total:
        return f"dropped none{of} input rows"
    meaning = {name: text for name, text in REASONS.values()}
    why = ", ".join(f"{n:,} with {meaning.get(name, name)}" for name, n in dropped.items() if n)
    return f"dropped {total:,}{of} input rows: {why}"
