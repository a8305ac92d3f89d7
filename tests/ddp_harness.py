"""The multi-process tests' harness: launching real torchrun and Lightning processes under a deadline that kills
their whole process group, reading what the worker scripts (tests/ddp_scripts/) report, and the checks of exactly
once and equal batches. Test modules import it; none imports another test module."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import repo_first, scaled

SCRIPTS = Path(__file__).resolve().parent / "ddp_scripts"
REPO = SCRIPTS.parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WORKERS = 2  # DataLoader workers per rank in every launch
# Lightning runs send 2 batches per worker message, so step 7 falls inside worker 1's second message (w0 w0 w1 w1 w0 w0
# w1 | w1): the resumed loader must give worker 0 worker 1's role and start it mid-message. torchrun runs keep the
# default (16 batches of 64 per message), so their snapshot at 5 falls inside worker 0's first.
CKPT_STEP = 7
MESSAGE_BATCHES = 2
SNAPSHOT_AT = 5
# the launches' own deadlines (scaled by LIFESEQ_TEST_TIME_SCALE in launch); each test's pytest timeout adds room for
# the fixtures it builds
TORCHRUN_S, LIGHTNING_S = 60, 90
# the ddp_spawn run (tests/conftest.py's lightning_spawn, which tests/reader/test_ddp.py and tests/test_compat.py
# read): the researchers' package, spawned ranks, workers started again each epoch, no sanity check, 2 val batches
SPAWN_RUN = ("--flavour", "pytorch_lightning", "--strategy", "ddp_spawn", "--no-persistent", "--no-sanity",
             "--limit-val", "2")
SPAWN_S = LIGHTNING_S + 60
SPAWN_CKPT = f"step={CKPT_STEP}.ckpt"  # the checkpoint its resume starts from, mid-epoch


# ---------------------------------------------------------------------------------------------------------------
# helpers


def launch(cmds: list[list[str]], logs: Path, timeout: float) -> None:
    """Run the commands side by side and wait for all; on the deadline (``timeout`` seconds, scaled) kill their
    process groups and fail.

    Like ``subprocess.run(cmd, timeout=...)``, but the kill reaches the whole group (torchrun's ranks, Lightning's
    re-launched rank, DataLoader workers), and output goes to files, so a chatty process cannot block on a full pipe.
    """
    env = repo_first({k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_WORLD_SIZE")})
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, cmd in enumerate(cmds):
        files.append(logs / f"launch-{i}.log")
        with open(files[-1], "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stacks = [_stacks(p.pid) for p in procs if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        pytest.fail(f"hung: killed after {timeout} s: {cmds}\n{_tails(files)}\n{''.join(stacks)}")
    failed = [(cmd, p.returncode) for cmd, p in zip(cmds, procs, strict=True) if p.returncode]
    assert not failed, f"{failed}\n{_tails(files)}"


def _stacks(group: int) -> str:
    """Where every process of a hung launch stands (py-spy dump), so a hang in CI says what waited for what."""
    pids = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        dump = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", pid],
                              capture_output=True, text=True, timeout=scaled(30))
        out.append(f"--- stacks of {pid}\n{dump.stdout[-3000:]}{dump.stderr[-500:]}")
    return "\n".join(out)


def _tails(files: list[Path]) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-6000:]}" for f in files)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_ranks(path: Path) -> list[dict[str, Any]]:
    ranks = json.loads(path.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    return ranks


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def assert_exactly_once(per_rank: list[list[list[int]]], expected: set[int]) -> None:
    """Every expected person in exactly one batch of one rank, and nothing else."""
    seen = [i for batches in per_rank for i in flat(batches)]
    assert len(seen) == len(set(seen)), f"{len(seen) - len(set(seen))} persons read twice"
    assert set(seen) == expected, f"missing {len(expected - set(seen))}, unexpected {len(set(seen) - expected)}"


def assert_equal_batches(per_rank: list[list[list[int]]], lengths: list[int]) -> None:
    """Each rank yielded as many batches as its loader's len() said, and all ranks the same number."""
    counts = [len(batches) for batches in per_rank]
    assert counts == lengths, f"batches per rank {counts}, len() said {lengths}"
    assert len(set(counts)) == 1 and counts[0] > 0, f"batches per rank {counts}: the all-reduce would hang"


def lightning(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "lightning_fit.py"), str(data), str(out), "--workers", str(WORKERS),
            "--batches-per-message", str(MESSAGE_BATCHES), *extra]


def fit_with_checkpoints(data: Path, out: Path, *extra: str, timeout: float = LIGHTNING_S) -> Path:
    """An uninterrupted 2-epoch fit that checkpoints every CKPT_STEP steps, after each validation and at each epoch's
    end in <dir>/ckpt; returns its result file. ``extra`` is the run's configuration, which its resumes repeat."""
    launch([lightning(data, out, "--epochs", "2", "--ckpt-every", str(CKPT_STEP), "--ckpt-dir",
                      str(out.parent / "ckpt"), *extra)], out.parent, timeout)
    return out


def resume(full: Path, data: Path, ckpt: str, out_dir: Path, *extra: str, timeout: float = LIGHTNING_S) -> Path:
    """fit(ckpt_path=<the full run's checkpoint ``ckpt``>) with the same configuration ``extra``, its result file and
    log in ``out_dir``; returns the result file (assert_resumed_exact compares it with the full run's)."""
    path = full.parent / "ckpt" / ckpt
    assert path.exists(), sorted(p.name for p in path.parent.iterdir())
    out = out_dir / "resumed.json"
    launch([lightning(data, out, "--epochs", "2", "--resume", str(path), *extra)], out_dir, timeout)
    return out


def assert_resumed_exact(full: Path, ckpt: str, out: Path) -> None:
    """The fit resumed from the full run's checkpoint ``ckpt`` (result file ``out``) trained on exactly the batches
    the uninterrupted run had left after it, batch for batch, on every rank: the rest of the epoch it stopped in
    (none for an end-of-epoch checkpoint), then the next epochs in full."""
    step = int(torch.load(full.parent / "ckpt" / ckpt, map_location="cpu", weights_only=False)["global_step"])
    for f, r in zip(read_ranks(full), read_ranks(out), strict=True):
        expected, done = {}, step  # epoch -> the full run's batches of it that come after the checkpoint
        for e in sorted(f["train"], key=int):
            if done < len(f["train"][e]):
                expected[e] = f["train"][e][done:]
            done = max(0, done - len(f["train"][e]))
        assert 0 < step and expected, f"checkpoint at step {step}: should fall inside the run"
        got = {e: len(b) for e, b in r["train"].items()}
        assert got == {e: len(b) for e, b in expected.items()}, f"rank {f['rank']}: batches per epoch after resume"
        assert r["train"] == expected, f"rank {f['rank']}: the resumed batches differ from the uninterrupted run's"


def assert_resume_exact(full: Path, data: Path, ckpt: str, tmp_path: Path, *extra: str,
                        timeout: float = LIGHTNING_S) -> None:
    """Resume the full run from its checkpoint ``ckpt`` with the same configuration and check the batches
    (assert_resumed_exact)."""
    assert_resumed_exact(full, ckpt, resume(full, data, ckpt, tmp_path, *extra, timeout=timeout))


def launch_log(result: Path) -> str:
    """What a launch that wrote ``result`` printed (stdout and stderr of all its processes)."""
    return (result.parent / "launch-0.log").read_text()
