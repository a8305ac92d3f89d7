"""The reader's multi-process fixture: the 2 x 2 torchrun run that tests/reader/test_ddp.py and test_ddp_elastic.py
both read, launched once a session (the tests only read its result file; the datasets are tests/conftest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ddp_harness import SNAPSHOT_AT, TORCHRUN, TORCHRUN_S, WORKERS, launch


@pytest.fixture(scope="session")
def torchrun_two(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchrun --standalone, 2 ranks x 2 workers, 2 epochs, a state_dict snapshot after SNAPSHOT_AT batches."""
    out = tmp_path_factory.mktemp("torchrun") / "result.json"
    launch([[*TORCHRUN, "--standalone", "--nproc_per_node=2", "torchrun_reader.py", str(ds8), str(out), "--workers",
             str(WORKERS), "--epochs", "2", "--snapshot-at", str(SNAPSHOT_AT)]], out.parent, TORCHRUN_S)
    return out
