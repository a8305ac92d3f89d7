"""The worker-start bench, quick: one worker, two passes, one run of each forkserver; the workers that import
Lightning themselves reach a pass's first batch later than those of the loader's preloading forkserver."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, repo_first, scaled

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]


def test_workers_importing_lightning_themselves_start_later() -> None:
    r = subprocess.run([sys.executable, "-m", "tools.bench_worker_start", "--workers", "1", "--passes", "2",
                        "--rounds", "1"], cwd=REPO, env=repo_first(dict(os.environ)), capture_output=True, text=True,
                       timeout=scaled(240))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = dict(re.findall(r"^\| (preloaded|each worker) \| ([\d.]+) \|", r.stdout, re.M))
    assert set(rows) == {"preloaded", "each worker"}, r.stdout
    # importing Lightning takes seconds of CPU; the preloaded worker imports nothing
    assert float(rows["each worker"]) > 2 * float(rows["preloaded"]), r.stdout
