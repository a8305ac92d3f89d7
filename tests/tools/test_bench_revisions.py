"""tools/bench_revisions.py's CPU pairs: one in-process pass timed in a checkout's own code, old and new in turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench_revisions import ROOT, cpu_pairs, cpu_pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_pairs_time_each_checkout_on_its_data(nomlm_dataset: Path, tmp_path: Path) -> None:
    """The working tree against itself: every pass takes CPU time, and each pair's ratio is its two times'."""
    rows = cpu_pairs(ROOT, {"old": nomlm_dataset, "new": nomlm_dataset}, pairs=1, passes=1)
    assert len(rows) == 1 and rows[0]["old_cpu_s"] > 0 and rows[0]["new_cpu_s"] > 0
    assert rows[0]["new_over_old"] == pytest.approx(rows[0]["new_cpu_s"] / rows[0]["old_cpu_s"])
    with pytest.raises(RuntimeError, match="the CPU pass exited 1"):
        cpu_pass(ROOT, tmp_path / "no-dataset", 1)
