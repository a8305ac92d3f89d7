"""The researchers' plain loop's data path (tests/ddp_scripts/plain_loop.py, their pytorch_port/pretrain.py as
docs/port-pretrain.diff leaves it; the diff on their own file: tests/test_port_pretrain.py) under torchrun, 2 ranks
on gloo, 2 workers each, validating and checkpointing mid-epoch: killed with SIGKILL after its checkpoint, resumed
from it, it trains on exactly the batches the uninterrupted run trained on after that point (same persons, same
masks), rank by rank; the next epoch is a new order. And docs/guides/train-plain-loop.md's script: as written on a
CPU (its CPU branch, in bounded memory), and at a tiny size resumed at the next epoch, and killed mid-epoch on 2
ranks then resumed on 1 and on 2 again."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from ddp_harness import SCRIPTS, TORCHRUN, WORKERS, launch
from helpers import repo_first, scaled, shardify, wait_for

from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest

VAL_EVERY = 10  # mid-epoch validation + checkpoint every 10 batches (about 43 a rank and epoch here)
PAUSE_AT = 14  # the killed run trains 4 batches past its checkpoint at step 10: the resumed run must train them again
RUN_S = 150


def loop(data: Path, out: Path, *extra: str) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", "plain_loop.py", str(data), str(out), "--workers",
            str(WORKERS), "--val-every", str(VAL_EVERY), *extra]


def trained(out: Path) -> list[list[dict[str, Any]]]:
    """Per rank, the batches it trained, in order."""
    return [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]


def kill_when_paused(cmd: list[str], out: Path, timeout: float) -> None:
    """Run ``cmd`` until both ranks paused at PAUSE_AT, then SIGKILL torchrun and each rank with its workers (torchrun
    starts every rank in a process group of its own), as a preemption kills a job's every process."""
    out.mkdir(parents=True)
    env = repo_first({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    paused = [out / f"paused-{r}" for r in range(2)]
    try:
        ok = wait_for(lambda: all(p.exists() for p in paused) or proc.poll() is not None, timeout)
        assert ok and proc.poll() is None, f"did not pause: {(out / 'launch.log').read_text()[-4000:]}"
    finally:
        groups = [proc.pid] + [int(p.read_text()) for p in paused if p.exists()]
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()
    assert wait_for(lambda: not any(Path(f"/proc/{g}").exists() for g in groups[1:]), 20), "a rank outlived the kill"


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


# -- docs/guides/train-plain-loop.md's script, as written ------------------------------------------------------
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "train-plain-loop.md"
# the script's CPU branch (where the tests run) and its validation interval
SETTINGS = "SIZE, EPOCHS, BATCH, PAD_TO = EncoderConfig(64, 256, 2, 4), 1, 32, None"
EVERY = 'VAL_EVERY, CKPT = 1000, "last.ckpt"'


@pytest.fixture(scope="module")
def ds1024(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide's conversion command, as written, on the first 500 persons of the sample's step-4 file (so that
    the CPU trains a few epochs in seconds); none of them longer than the tests' padding, WIDTH."""
    command = re.search(r"```bash\n(shardify convert .*?)\n```", GUIDE.read_text(), re.S)
    assert command is not None
    out = tmp_path_factory.mktemp("guide")
    pq.write_table(pq.read_table(sample / "sequences.parquet").slice(0, 500), out / "sequences.parquet")
    args = [str(sample / a) if a == "vocab.csv" else str(out / a) if a in ("ds/", "sequences.parquet") else a
            for a in command.group(1).split()[2:]]
    code, output = shardify("convert", *args)
    assert code == 0, output
    manifest = read_manifest(str(out / "ds"))
    assert max(split_lengths(str(out / "ds"), manifest, s)[0].max() for s in manifest.splits) <= WIDTH
    return out / "ds"


WIDTH = 288  # the guide's padding in these tests: the 500 persons' longest, 280 tokens, to a multiple of 8


def guide_script(data: Path, stop_after: int) -> str:
    """The guide's script on ``data`` at a tiny size, for 2 epochs but stopping after epoch ``stop_after`` (as a job
    that reaches its time limit after an end-of-epoch checkpoint): its only edits."""
    script = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    loop = "for epoch in range(data.epoch, EPOCHS):"
    assert script is not None and all(t in script.group(1) for t in (SETTINGS, EVERY, '"ds/"', loop))
    # the GPU branch's batch and a fixed padding (its path: the host pads), a tinier model, 2 epochs, a checkpoint
    # every 4 batches. The width is the persons' longest (280 tokens) rounded up, not the GPU's 1,024: on a CPU
    # 1,024 only multiplies the attention's work and memory by 13 (a launch took 106 CPU s against 26, most of them
    # the kernel clearing fresh pages for the score tensors)
    tiny = f"SIZE, EPOCHS, BATCH, PAD_TO = EncoderConfig(32, 64, 1, 2), 2, 50, {WIDTH}"
    return (script.group(1).replace(SETTINGS, tiny)
            .replace(EVERY, 'VAL_EVERY, CKPT = 4, "last.ckpt"').replace('"ds/"', repr(str(data)))
            .replace(loop, f"for epoch in range(data.epoch, {stop_after + 1}):"))


GUIDE_S = 300  # one launch of the guide's script: six workers a rank start, on a 2-core machine shared by others


def run_torchrun(cmd: list[str], cwd: Path, timeout: float, killed: bool = False) -> str:
    """``cmd`` (torchrun, or one process) to completion, its output; on the deadline SIGKILL torchrun and each rank's
    process group (torchrun gives every rank one of its own) and fail. ``killed``: the run must end killed (a
    non-zero exit), not complete."""
    env = repo_first({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    with open(cwd / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(scaled(timeout))
    except subprocess.TimeoutExpired:
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for group in [proc.pid, *map(int, ranks)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        proc.wait()
    output = (cwd / "launch.log").read_text()
    assert (proc.returncode != 0) if killed else (proc.returncode == 0), output[-4000:]
    return output


@pytest.mark.slow
@pytest.mark.timeout(2 * GUIDE_S + 60)
def test_the_guides_loop_runs_and_resumes_under_torchrun(ds1024: Path, tmp_path: Path) -> None:
    """Two ranks: stopped after epoch 0, the script started again goes on from its checkpoint with epoch 1."""
    outputs = []
    for stop_after in (0, 1):
        (tmp_path / "train.py").write_text(guide_script(ds1024, stop_after))
        outputs.append(run_torchrun([*TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py"], tmp_path,
                                    GUIDE_S))
    assert re.findall(r"epoch (\d+): train mlm", outputs[0]) == ["0"]
    assert re.findall(r"epoch (\d+): train mlm", outputs[1]) == ["1"]  # resumed at the next epoch, not epoch 0
    persons = json.loads((ds1024 / "manifest.json").read_text())["totals"]["persons"]
    # no pattern here is anchored at a line start: the ranks share one stdout, and a line may follow another
    # rank's text that has no newline yet ("rank 1: 240 persons to embedrank 0: 245 persons to embed", seen)
    embedded = [int(n) for n in re.findall(r"rank \d: (\d+) persons to embed", outputs[1])]
    assert len(embedded) == 2 and sum(embedded) == persons  # predict: everyone once


CPU_S, CPU_MB = 300, 2048  # the guide's script as written, one process on a CPU: its deadline and peak memory


@pytest.mark.slow
@pytest.mark.timeout(CPU_S + 60)
def test_the_guides_script_runs_on_a_cpu_as_written(ds1024: Path, tmp_path: Path) -> None:
    """``python train.py`` exactly as the guide writes it, on a machine without a GPU (CUDA hidden): its CPU branch
    trains an epoch, validates and embeds every person, its process under CPU_MB at its peak (BERT-base at 1,024
    tokens grew past 8 GB there before its first step)."""
    script = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert script is not None
    (tmp_path / "train.py").write_text(script.group(1))
    (tmp_path / "ds").symlink_to(ds1024)
    # the peak of the largest child: train.py's own process, which holds the model (its workers are its children)
    wrapper = ("import os, resource, subprocess, sys\n"
               "code = subprocess.run([sys.executable, 'train.py'], env=dict(os.environ, CUDA_VISIBLE_DEVICES='')"
               ").returncode\n"
               "print(f'peak {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024} MB', flush=True)\n"
               "sys.exit(code)\n")
    output = run_torchrun([sys.executable, "-c", wrapper], tmp_path, CPU_S)
    assert re.findall(r"epoch (\d+): train mlm", output) == ["0"], output[-3000:]
    persons = json.loads((ds1024 / "manifest.json").read_text())["totals"]["persons"]
    assert re.findall(r"rank 0: (\d+) persons to embed", output) == [str(persons)], output[-3000:]
    peak = re.search(r"peak (\d+) MB", output)
    assert peak is not None and int(peak.group(1)) < CPU_MB, output[-3000:]


# the guide's script, killed as a preemption kills a job: right after the first mid-epoch checkpoint of an epoch
SAVED_MID_EPOCH = "                save()  # after this step: a resume goes on with the next batch\n"
SCHEDULE_AT_END = "    embedded = sum("
RESUME_S = 420  # one launch of it: the one-process resume trains twice a rank's batches


def killed_in(script: str, epoch: int) -> str:
    """``script`` SIGKILLed with its loader workers (its process group) after epoch ``epoch``'s first mid-epoch
    checkpoint, every rank once rank 0's file is written; and printing where its schedule ended, if it gets there."""
    kill = (f"                if epoch == {epoch}:  # preempted\n"
            "                    if dist.is_initialized():\n"
            "                        dist.barrier()  # rank 0 saved\n"
            "                    os.killpg(os.getpgrp(), 9)\n")
    return schedule_printed(script.replace(SAVED_MID_EPOCH, SAVED_MID_EPOCH + kill))


def schedule_printed(script: str) -> str:
    """``script`` printing, once trained, the scheduler's step, its length and this arrangement's steps in the run."""
    line = ('    print(f"rank {rank}: schedule at {scheduler.last_epoch} of {scheduler.total_steps}, '
            'run {EPOCHS * len(data.train())}", flush=True)\n')
    return script.replace(SCHEDULE_AT_END, line + SCHEDULE_AT_END)


@pytest.mark.slow
@pytest.mark.timeout(3 * RESUME_S + 60)
def test_the_guides_loop_killed_resumes_on_another_number_of_ranks(ds1024: Path, tmp_path: Path) -> None:
    """Two ranks killed after a mid-epoch checkpoint; one process (``python train.py``, no torchrun) goes on from it
    to the end of the epoch; two ranks go on from that one process's checkpoint to the end of the run. Each resume
    loads the model saved on the other rank count, and its OneCycleLR is the cycle of its own arrangement's steps (one
    process trains about twice the batches an epoch that a rank of two does): half run at the end of epoch 0,
    ended at the run's last step. Sized for the killed run's arrangement, it stops the last run ('Tried to step')."""
    for run, (stop_after, cmd) in enumerate([(1, [*TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py"]),
                                             (0, [sys.executable, "train.py"]),
                                             (1, [*TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py"])]):
        script = guide_script(ds1024, stop_after)  # batch 50: 6 batches a rank of two, 10 in one process
        assert SAVED_MID_EPOCH in script and SCHEDULE_AT_END in script
        (tmp_path / "train.py").write_text(killed_in(script, 0) if run == 0 else schedule_printed(script))
        output = run_torchrun(cmd, tmp_path, RESUME_S, killed=run == 0)
        if run == 0:  # killed at step 4 of epoch 0, its checkpoint saved there
            ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
            assert (ckpt["data"]["train"]["epoch"], ckpt["data"]["train"]["batches"]) == (0, 4), ckpt["data"]
            assert not [k for k in ckpt["model"] if k.startswith("module.")], "saved the DDP wrapper's keys"
            continue
        assert re.findall(r"epoch (\d+): train mlm", output) == [str(stop_after)], output[-3000:]
        # not anchored at a line's start: the ranks share one stdout, and a rank's line may follow another's text
        # that has no newline yet ("... val mlm 8.002rank 1: schedule at ...", seen in CI)
        ends = [tuple(map(int, row)) for row in re.findall(r"rank \d: schedule at (\d+) of (\d+), run (\d+)",
                                                          output)]
        assert len(ends) == (1 if run == 1 else 2), output[-3000:]
        for at, total, steps in ends:
            assert total == steps, f"a cycle of {total} steps, the run has {steps} in this arrangement"
            assert at * 2 == steps if run == 1 else at == steps, f"the cycle at {at} of {steps}"
        if run == 1:
            alone = ends[0][2]
        else:
            assert alone > ends[0][2], "one process should train more batches than a rank of two"
    persons = json.loads((ds1024 / "manifest.json").read_text())["totals"]["persons"]
    embedded = [int(n) for n in re.findall(r"rank \d: (\d+) persons to embed", output)]  # not anchored, as above
    assert len(embedded) == 2 and sum(embedded) == persons  # loaded into two ranks, predict reads everyone once
