"""The token plan's reading cost: every rank's workers together decode each stream place once, the windows that a
slot edge cuts included (plan/balance.py split_edges), however the windows, arrangement and lookahead fall."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lifeseq_shards.plan.resume import Arrangement
from lifeseq_shards.plan.tokens import TokenSchedule


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 4), st.integers(0, 3), st.sampled_from([16, 64, 300]),
       st.integers(0, 2))
def test_each_place_is_decoded_once(seed: int, ranks: int, workers: int, window: int, epoch: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = tuple(int(s) for s in rng.integers(20, 200, 12))
    sched = TokenSchedule(rng.integers(1, 61, sum(sizes)), sizes, seed=seed % 7)
    lay = Arrangement.of_budget(8 * 60, ranks, workers, window=window)
    try:
        plan, _ = sched.leg(epoch, (), lay)
    except ValueError:  # a split too small for the arrangement: refused
        return
    decoded = np.zeros(sum(sizes), dtype=np.int64)
    for rank in range(ranks):
        for worker in range(lay.workers):
            batches = [plan.batch(int(s), rank) for s in plan.worker_steps(worker)]
            for win, _ in sched.ordered_windows(epoch, window, batches):
                decoded[win.start : win.stop] += 1
    assert (decoded == 1).all()
