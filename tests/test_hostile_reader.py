"""The reader as a hostile user meets it (issue 12): edited manifests, shards swapped in from elsewhere, resume
with other settings, and a training process killed with SIGKILL. Each case failed before the reader checked it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


# -- 5. a killed training process takes everything it started along -----------------------------------------------
def group_pids(pgid: int) -> set[int]:
    """Live (not zombie) processes of a process group."""
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = (Path("/proc") / d / "stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state != "Z":
            out.add(int(d))
    return out


def shm_files(pids: set[int]) -> set[Path]:
    """The /dev/shm files the processes have mapped (semaphores, shared memory), unlinked ones left out."""
    out = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in (Path("/proc") / str(pid) / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(f"{SHM}/") and not path[0].endswith("(deleted)"):
                    out.add(Path(path[0]))
    return out


def wait_until(check: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not SHM.is_dir(), reason="Linux /dev/shm and /proc")
def test_a_killed_training_process_leaves_nothing_behind(nomlm_dataset: Path) -> None:
    """`python train.py | tee log` after an out-of-memory kill: the pipe reaches EOF (no forkserver, worker or
    resource tracker keeps it open), no process of the training's group survives, and its semaphores are gone
    from /dev/shm."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "ddp_scripts" / "train_until_killed.py"),
                             str(nomlm_dataset)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own process group: what it starts is found by group
    assert proc.stdout is not None
    shm: set[Path] = set()
    try:
        for line in proc.stdout:
            if line.startswith(b"READY"):
                break
        else:
            pytest.fail("the training script ended before reading 5 batches")
        started = group_pids(proc.pid) - {proc.pid}
        assert len(started) >= 3, started  # the forkserver, 2 workers (and the resource tracker)
        shm = shm_files(started | {proc.pid})
        assert shm, "expected the loader's queues to hold semaphores in /dev/shm"
        proc.kill()
        proc.wait()
        eof = threading.Event()
        threading.Thread(target=lambda: (proc.stdout.read(), eof.set()), daemon=True).start()  # type: ignore[union-attr]
        assert eof.wait(20), f"the pipe stayed open 20 s after the kill: held by {group_pids(proc.pid)}"
        assert wait_until(lambda: not group_pids(proc.pid), 10), f"survivors: {group_pids(proc.pid)}"
        assert wait_until(lambda: not any(p.exists() for p in shm), 10), \
            f"left in /dev/shm: {sorted(p.name for p in shm if p.exists())}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in shm:  # the test's own leftovers only (those its processes had mapped)
            p.unlink(missing_ok=True)
