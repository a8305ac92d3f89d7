"""The researchers' plain loop (tests/ddp_scripts/plain_loop.py, their pytorch_port/pretrain.py as
docs/port-pretrain.diff leaves it) under torchrun, 2 ranks on gloo, 2 workers each, validating and checkpointing
mid-epoch: killed with SIGKILL after its checkpoint, resumed from it, it trains on exactly the batches the
uninterrupted run trained on after that point (same persons, same masks), rank by rank; the next epoch is a new
order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import repo_first, wait_for
from test_ddp import SCRIPTS, TORCHRUN, WORKERS, launch

from lifeseq_shards.convert import ConvertOptions, convert_dataset

VAL_EVERY = 10  # mid-epoch validation + checkpoint every 10 batches (about 43 a rank and epoch here)
PAUSE_AT = 14  # the killed run trains 4 batches past its checkpoint at step 10: the resumed run must train them again
RUN_S = 150


@pytest.fixture(scope="module")
def ds8(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds8")
    convert_dataset([str(sample / "encoded_nomlm.h5")], out, str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=8))
    return out


def loop(data: Path, out: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", "plain_loop.py", str(data), str(out), "--workers",
            str(WORKERS), "--val-every", str(VAL_EVERY), *extra]


def trained(out: Path) -> list[list[dict[str, Any]]]:
    """Per rank, the batches it trained, in order."""
    return [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]


def kill_when_paused(cmd: list[str], out: Path, timeout: float) -> None:
    """Run ``cmd`` until both ranks paused at PAUSE_AT, then SIGKILL its whole process group (torchrun, the ranks,
    their workers), as a preemption's kill would."""
    out.mkdir(parents=True)
    env = repo_first({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        paused = wait_for(lambda: all((out / f"paused-{r}").exists() for r in range(2)) or proc.poll() is not None,
                          timeout)
        assert paused and proc.poll() is None, f"did not pause: {(out / 'launch.log').read_text()[-4000:]}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_S + 60)
def test_killed_plain_loop_resumes_exactly_rank_by_rank(ds8: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    launch([loop(ds8, full)], tmp_path / "full-logs", RUN_S)
    killed = tmp_path / "killed"
    kill_when_paused(loop(ds8, killed, "--pause-at", str(PAUSE_AT)), killed, RUN_S)
    checkpoint = killed / "ckpt" / "last.ckpt"  # saved at step 10, the last before the kill
    resumed = tmp_path / "resumed"
    launch([loop(ds8, resumed, "--resume", str(checkpoint))], tmp_path / "resumed-logs", RUN_S)

    for rank, (whole, cut, rest) in enumerate(zip(trained(full), trained(killed), trained(resumed), strict=True)):
        assert len(cut) == PAUSE_AT and cut == whole[:PAUSE_AT], f"rank {rank}: the killed run trained otherwise"
        # the resumed run starts after the checkpoint's batch (not after the kill's, not at the epoch's start),
        # numbered as the uninterrupted run numbers it, and trains on the same persons with the same masks
        assert rest[0]["epoch"] == 0 and rest[0]["batch"] == VAL_EVERY + 1, f"rank {rank}: resumed at {rest[0]}"
        assert rest == whole[VAL_EVERY:], f"rank {rank}: the resumed batches differ from the uninterrupted run's"
        epochs = [[b for b in whole if b["epoch"] == e] for e in (0, 1)]
        assert len(epochs[0]) == len(epochs[1]) > VAL_EVERY
        first, second = ([i for b in e for i in b["ids"]] for e in epochs)
        assert first != second and sorted(first) != sorted(second), f"rank {rank}: epoch 1 repeated epoch 0"
    persons = [{i for b in ranks for i in b["ids"] if b["epoch"] == 0} for ranks in trained(full)]
    assert not persons[0] & persons[1], "a person on both ranks in one epoch"
