"""SIGTERM, what `scancel`, a Slurm time limit and a preemption send first (to every process of the job step),
to a real 2-rank Lightning fit with 2 DataLoader workers per rank, mid-epoch: the fit ends within a bound with
exit status 143 (preempted, on both Lightning packages and both stacks), no process of it is left, and none of the
/dev/shm files (the loaders' semaphores) its processes had mapped stays. docs/reference/ddp.md says what SLURM users
should set."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, group_pids, repo_first, shm_files, wait_for

from lifeseq_shards.signals import PREEMPTED

SCRIPTS = REPO / "tests" / "ddp_scripts"
ENDS_WITHIN_S = 30  # from SIGTERM to the last process gone; it takes 5-11 s on a loaded 2-core machine
STARTED = 2 + 2 + 2 * 2  # the ranks, their forkservers and workers (and the resource trackers)
# validations with a sync_dist all-reduce per step twice an epoch, the device-side prefetch thread, dynamic masks
FIT = ("--masking", "dynamic", "--val-check-interval", "0.5", "--prefetch")


def sigterm_mid_fit(data: Path, tmp_path: Path, flavour: str,
                    delay: float) -> tuple[float, set[int], set[Path], int | None, str]:
    """Start a 50-epoch fit in a process group of its own, SIGTERM the group ``delay`` s after its workers run;
    (seconds until its last process was gone or the bound passed, the survivors, the /dev/shm files left, the exit
    status of the process started (None while it runs), its output)."""
    log = tmp_path / f"fit-{flavour}-{delay}.log"
    with open(log, "w") as out:
        fit = subprocess.Popen([sys.executable, str(SCRIPTS / "lightning_fit.py"), str(data), str(tmp_path / "r.json"),
                                "--workers", "2", "--epochs", "50", "--flavour", flavour, *FIT,
                                "--stop-on-sigterm"], cwd=SCRIPTS,
                               env=repo_first(os.environ), stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        assert wait_for(lambda: len(group_pids(fit.pid)) >= STARTED or fit.poll() is not None, 120), log.read_text()
        assert fit.poll() is None, log.read_text()
        time.sleep(delay)
        mapped = shm_files(group_pids(fit.pid))
        assert mapped, "expected the loaders' queues to hold semaphores in /dev/shm"
        t0 = time.monotonic()
        os.killpg(fit.pid, signal.SIGTERM)
        wait_for(lambda: not group_pids(fit.pid), ENDS_WITHIN_S)
        took, survivors = time.monotonic() - t0, group_pids(fit.pid)
        # its threads can outlive a zombie main thread by a moment (exit_group), which is reaped only after them
        wait_for(lambda: fit.poll() is not None, 5)
        code = fit.poll()
        wait_for(lambda: not any(p.exists() for p in mapped), 5)
        return took, survivors, {p for p in mapped if p.exists()}, code, log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fit.pid, signal.SIGKILL)
        fit.wait()


@pytest.mark.slow
@pytest.mark.timeout(6 * (120 + ENDS_WITHIN_S + 10))
@pytest.mark.parametrize("flavour", ["lightning", "pytorch_lightning"])
def test_a_sigtermed_fit_ends_within_seconds_leaving_nothing(ds8: Path, tmp_path: Path, flavour: str) -> None:
    """Before: 2 of 4 tries deadlocked both ranks until SIGKILL, leaving 56 semaphore files in /dev/shm; then, on
    Lightning's Ctrl-C path, the fit exited 0 on Lightning 2.2 (as a finished one) and 1 on the newest (as a crash)."""
    for delay in (0.5, 2.0, 4.0):
        took, survivors, left, code, log = sigterm_mid_fit(ds8, tmp_path, flavour, delay)
        assert not survivors, f"{flavour}, SIGTERM {delay} s in: {survivors} still running after {took:.0f} s"
        assert not left, f"{flavour}, SIGTERM {delay} s in: left in /dev/shm: {sorted(p.name for p in left)}"
        assert code == PREEMPTED, f"{flavour}, SIGTERM {delay} s in: exit status {code}\n{log[-3000:]}"
        assert log.count(f"exit status {PREEMPTED} (preempted") == 1, log[-3000:]  # rank 0 says it, once
