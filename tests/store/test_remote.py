"""Remote reads at their edges (lifeseq_shards/store/remote.py): a `pipe:` command that stops sending fails after
LIFESEQ_HTTP_STALL_S instead of hanging the job, the command dies with the process that reads it (however that
one dies), a stall setting that cannot work is refused naming the variable, a failed manifest command is one line;
a read that has its blocks and closes a command still sending is no failure, a command that sends nothing is.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import read_all, repo_first, shardify, wait_for

from lifeseq_shards.reader import ShardedDataset, World
from lifeseq_shards.store.manifest import ManifestError
from lifeseq_shards.store.remote import STALL_ENV, RemoteSettingError, read_manifest

# `pipe:` command: sends the manifest whole; of a shard, writes its pid to PIDS/<pid>, sends 50 KB (at most half of
# it), then nothing
STALLER = """import os, sys, time
path, pids = sys.argv[1], sys.argv[2]
with open(path, "rb") as fh:
    if path.endswith("manifest.json"):
        sys.stdout.buffer.write(fh.read())
        sys.exit(0)
    open(os.path.join(pids, str(os.getpid())), "w").close()
    sys.stdout.buffer.write(fh.read(min(50_000, os.path.getsize(path) // 2)))
    sys.stdout.buffer.flush()
    time.sleep(600)
"""
# reads the train split through the staller's root with N workers; the test SIGKILLs it mid-read
READER = """import sys
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World

if __name__ == "__main__":
    workers = int(sys.argv[2])
    ds = ShardedDataset(sys.argv[1], batch_size=100, world=World(0, 1), num_workers=workers)
    for _ in ShardedLoader(ds, ring_bytes=0):
        pass
"""


@pytest.fixture
def staller(nomlm_dataset: Path, tmp_path: Path) -> tuple[str, Path]:
    """A `pipe:` root over the dataset whose shard commands stall after 50 KB, and the directory of their pids."""
    script, pids = tmp_path / "staller.py", tmp_path / "pids"
    script.write_text(STALLER)
    pids.mkdir()
    return f"pipe:{sys.executable} {script} {nomlm_dataset}/{{}} {pids}", pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def started(pids: Path) -> list[int]:
    return [int(p.name) for p in pids.iterdir()]


@pytest.mark.timeout(60)
def test_a_pipe_command_that_stops_sending_fails_and_is_killed(staller: tuple[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the read waited forever on a command that sent 50 KB of a shard and then nothing."""
    root, pids = staller
    monkeypatch.setenv(STALL_ENV, "1")
    ds = ShardedDataset(root, batch_size=100, world=World(0, 1))
    t0 = time.monotonic()
    before, after = (re.escape(part) for part in root.split("{}"))
    with pytest.raises(OSError, match=rf"^{before}train/shard-\d+\.tar{after}: block 0: the command sent no byte for "
                                      rf"1 s \({STALL_ENV}\); killed it$"):
        list(ds)
    assert time.monotonic() - t0 < 20
    assert started(pids) and wait_for(lambda: not any(map(alive, started(pids))), 5), "the command outlived its read"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_pipe_command_dies_with_its_killed_reader(staller: tuple[str, Path], tmp_path: Path, workers: int) -> None:
    """Before: after the training process was SIGKILLed, the command (`sh` and its child) lived on, stalled."""
    root, pids = staller
    script = tmp_path / "reader.py"
    script.write_text(READER)
    reader = subprocess.Popen([sys.executable, str(script), root, str(workers)], env=repo_first(os.environ),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: bool(started(pids)) or reader.poll() is not None, 60), "no shard command started"
        assert reader.poll() is None, reader.stderr.read()  # type: ignore[union-attr]
        commands = started(pids)
        reader.send_signal(signal.SIGKILL)
        reader.wait()
        assert wait_for(lambda: not any(map(alive, commands)), 10), f"orphans: {[p for p in commands if alive(p)]}"
    finally:
        reader.kill()
        for pid in started(pids):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "soon", ""])
def test_a_stall_setting_that_cannot_work_is_refused_naming_it(nomlm_dataset: Path, monkeypatch: pytest.MonkeyPatch,
                                                               value: str) -> None:
    """Before: 0 turned every limit off (a stalled read hung the job); the others were reported as the manifest's
    errors, one quoting the whole curl command."""
    monkeypatch.setenv(STALL_ENV, value)
    message = f"{STALL_ENV}={value!r}: the seconds a remote read may go without a byte before it fails must be a whole "
    for root in (f"pipe:cat {nomlm_dataset}/{{}}", "http://127.0.0.1:9/ds"):
        with pytest.raises(RemoteSettingError, match=re.escape(message)):
            ShardedDataset(root, batch_size=100, world=World(0, 1))
    code, out = shardify("inspect", f"pipe:cat {nomlm_dataset}/{{}}")
    assert code == 2 and out.strip() == f"error: {message}number >= 1 (default 60); there is no 'off'", out


def test_a_failed_manifest_command_is_one_line_with_its_status(nomlm_dataset: Path) -> None:
    with pytest.raises(ManifestError, match=re.escape("pipe:exit 3 # manifest.json: cannot read the manifest (the "
                                                      "command exited with status 3)")):
        read_manifest("pipe:exit 3 # {}")


# -- `pipe:` commands at the edges of a read --------------------------------------------------------------------------
SLOWCAT = """import sys, time
with open(sys.argv[1], "rb") as fh:
    for chunk in iter(lambda: fh.read(2048), b""):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        time.sleep(0.002)
"""


@pytest.mark.timeout(120)
def test_a_pipe_read_that_stops_early_is_not_the_commands_failure(blocks16: Path, tmp_path: Path) -> None:
    """A window that ends inside a shard reads only its first blocks and closes the stream while the command still
    sends (as `aws s3 cp ... -` does over a network). Before: the command's exit status after that close
    (BrokenPipeError: exit 1; only a shell's 141 was let through) failed the epoch with `exit 1 (read)`."""
    script = tmp_path / "slowcat.py"
    script.write_text(SLOWCAT)
    root = f"pipe:{sys.executable} {script} {blocks16}/{{}}"
    local = read_all(blocks16)
    remote = read_all(root)  # type: ignore[arg-type]
    assert len(remote) == len(local) == 56
    assert all(torch.equal(a["person_id"], b["person_id"]) for a, b in zip(remote, local, strict=True))


@pytest.mark.parametrize(("command", "status"), [("exit 3", " (the command exited with status 3)"), ("true", "")])
def test_a_pipe_command_that_sends_nothing_is_one_line(nomlm_dataset: Path, command: str, status: str) -> None:
    """The shards' command fails (or succeeds) without a byte: one line naming it, with its exit status when it
    failed (the manifest was read; the shard reads go through the command)."""
    ds = ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1))
    ds.shards = [dataclasses.replace(s, url=f"pipe:{command} # {s.url}") for s in ds.shards]
    with pytest.raises(OSError) as err:
        list(ds)
    assert re.fullmatch(rf"pipe:{command} # \S+/train/shard-\d+\.tar: ended after 0 blocks, needed 1"
                        rf"{re.escape(status)}", str(err.value)), str(err.value)
