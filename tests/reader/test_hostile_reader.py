"""The reader as a hostile user meets it (issue 12): edited manifests, shards swapped in from elsewhere, resume
with other settings, and a training process killed with SIGKILL. Each case failed before the reader checked it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, convert_nomlm, group_pids, repo_first, shardify, shm_files, to_format2, trained_ids, wait_for

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.store.manifest import Manifest, ManifestError, fingerprint

SHM = Path("/dev/shm")
ManifestJSON = dict[str, Any]


@pytest.fixture(scope="module")
def reseeded(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_nomlm.h5 converted again with another seed: same shard names and sizes, other persons in them."""
    return convert_nomlm(sample, tmp_path_factory.mktemp("reseeded"), seed=1)


@pytest.fixture(scope="module")
def small_blocks(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_nomlm.h5 in 16-person blocks: each 115-person shard has 8 blocks."""
    return convert_nomlm(sample, tmp_path_factory.mktemp("small_blocks"), block_persons=16)


def copy_of(root: Path, tmp_path: Path) -> Path:
    shutil.copytree(root, tmp_path / "ds")
    return tmp_path / "ds"


@pytest.fixture
def copy(nomlm_dataset: Path, tmp_path: Path) -> Path:
    return copy_of(nomlm_dataset, tmp_path)


def edit(root: Path, change: Callable[[ManifestJSON], object], refit: bool = False) -> None:
    """Edit the manifest; with ``refit``, recompute its fingerprint too (an edit that hides itself)."""
    m = json.loads((root / "manifest.json").read_text())
    change(m)
    if refit:
        typed = Manifest.from_json(m)
        m["fingerprint"] = fingerprint(typed.schema, [e.sha256 for _, e in typed.entries()])
    (root / "manifest.json").write_text(json.dumps(m))


def read_all(root: Path, split: str = "train") -> list[dict[str, torch.Tensor]]:
    return list(ShardedDataset(root, split, batch_size=100, world=World(0, 1)))


def assert_one_line_exit_2(args: list[str], needle: str) -> None:
    code, out = shardify(*args)
    assert code == 2, out
    assert out.count("\n") == 1 and out.startswith("error: ") and needle in out, out


# -- 1. the reader checks that the files are the manifest's ----------------------------------------------------------
def test_a_shard_copied_over_another_is_refused(copy: Path) -> None:
    """Before: shard 3's persons read twice, shard 7's never."""
    shutil.copy(copy / "train" / "shard-000003.tar", copy / "train" / "shard-000007.tar")
    with pytest.raises(OSError, match=r"train/shard-000007\.tar: block 0: not the shard the manifest names"):
        read_all(copy)


def test_a_same_named_shard_from_another_conversion_is_refused(copy: Path, reseeded: Path) -> None:
    """Before: read without a word (115 persons of another split and shuffle)."""
    shutil.copy(reseeded / "train" / "shard-000003.tar", copy / "train" / "shard-000003.tar")
    with pytest.raises(OSError, match=r"train/shard-000003\.tar: block 0: not the shard the manifest names"):
        read_all(copy)


def swap(a: str, b: str) -> Callable[[ManifestJSON], None]:
    def change(m: ManifestJSON) -> None:
        for f in m["schema"]:
            f["name"] = {a: b, b: a}.get(f["name"], f["name"])
    return change


@pytest.mark.parametrize("fields", [("age", "segment"), ("tokens", "masked_tokens")])
def test_a_schema_with_swapped_fields_is_refused(mlm_dataset: Path, tmp_path: Path, fields: tuple[str, str]) -> None:
    """Before: every person's values read into the other field. The fingerprint is refitted, so only the blocks'
    schema tag tells; verify says so too."""
    ds = copy_of(mlm_dataset, tmp_path)
    edit(ds, swap(*fields), refit=True)
    with pytest.raises(OSError, match=r"shard-\d+\.tar: block 0: block written with another schema"):
        read_all(ds)
    code, out = shardify("verify", str(ds))
    assert code == 1 and "block written with another schema" in out


def test_an_edited_schema_is_given_away_by_the_fingerprint(copy: Path) -> None:
    """Without the refit, format-2 datasets (no schema tag in their blocks) are protected too."""
    edit(copy, lambda m: (to_format2(m), swap("age", "segment")(m)))
    with pytest.raises(ManifestError, match=r"manifest\.json: fingerprint does not match"):
        ShardedDataset(copy)


def test_format2_datasets_still_read_once_upgraded(copy: Path, nomlm_dataset: Path) -> None:
    """`shardify upgrade` adds the blocks' checksums that the reader requires (tests/store/test_block_checks.py)."""
    edit(copy, to_format2)
    assert shardify("upgrade", str(copy))[0] == 0
    got, want = read_all(copy), read_all(nomlm_dataset)
    assert len(got) == len(want) and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want, strict=True))


def test_lowered_counts_are_refused(copy: Path) -> None:
    """Before: 15 persons of each 115-person shard silently not read (13 %)."""
    def lower(m: ManifestJSON) -> None:
        info = m["splits"]["train"]
        for e in info["shards"]:
            e["samples"] = 100
        info["shard_persons"], info["persons"] = 100, info["persons"] - 15 * len(info["shards"])

    edit(copy, lower)
    with pytest.raises(OSError, match=r"shard-\d+\.tar: block 0: 115 persons, where the manifest's 100 persons"):
        read_all(copy)


def test_counts_lowered_by_whole_blocks_are_refused(small_blocks: Path, tmp_path: Path) -> None:
    """115 -> 112 persons: 7 whole blocks of 16, so every block read holds what the manifest says; the shard's
    8th block, which the manifest does not have, gives it away."""
    ds = copy_of(small_blocks, tmp_path)

    def lower(m: ManifestJSON) -> None:
        for e in m["splits"]["train"]["shards"]:
            e["samples"] = 112

    edit(ds, lower)
    with pytest.raises(OSError, match=r"block 7: more blocks than the manifest's 112 persons in blocks of 16 make"):
        read_all(ds)


def test_a_count_unlike_the_others_names_the_manifest_and_the_shard(copy: Path) -> None:
    """Before: `balanced mode needs shards of one size, got sizes [115, 116]`, naming no dataset or shard."""
    def raise_one(m: ManifestJSON) -> None:
        m["splits"]["train"]["shards"][5]["samples"] += 1

    edit(copy, raise_one)
    with pytest.raises(ManifestError, match=rf"{re.escape(str(copy))}/manifest\.json: split train: shard "
                                            r"train/shard-000005\.tar counts 116 persons, the split's other shards "
                                            r"115 each"):
        ShardedDataset(copy)


@pytest.mark.parametrize("file", ["../escape.tar", "/etc/hostname", "train/../../escape.tar", "./train/x.tar",
                                  "train/shard-000001.tar; touch pwned", ""])
def test_a_shard_path_leaving_the_dataset_is_refused(copy: Path, file: str) -> None:
    """Before: the reader opened ../escape.tar (and a `pipe:` root would run what follows a ';')."""
    edit(copy, lambda m: m["splits"]["train"]["shards"][0].update(file=file))
    needle = f"manifest.json: splits.train.shards[0].file {file!r} is not a plain relative path inside the dataset"
    with pytest.raises(ManifestError) as err:
        ShardedDataset(copy)
    assert needle in str(err.value)
    assert_one_line_exit_2(["verify", str(copy)], needle)


def test_a_shard_listed_twice_is_refused(copy: Path) -> None:
    """Before: its persons read twice."""
    edit(copy, lambda m: m["splits"]["train"]["shards"][1].update(file="train/shard-000000.tar"))
    with pytest.raises(ManifestError, match=r"shards\[1\]\.file 'train/shard-000000.tar' is listed twice"):
        ShardedDataset(copy)


def test_verify_names_a_shard_path_that_is_a_directory(copy: Path) -> None:
    """Before: a traceback (IsADirectoryError) from verify."""
    edit(copy, lambda m: m["splits"]["train"]["shards"][0].update(file="val"))
    code, out = shardify("verify", str(copy))
    assert code == 1 and "val: missing (a directory)" in out, out
    with pytest.raises(IsADirectoryError, match=r"Is a directory: .*/val"):
        read_all(copy)


@pytest.mark.parametrize("params", [[], {"vocab_size": "2971"}])
def test_conversion_params_of_another_type_are_one_line(copy: Path, params: object) -> None:
    """Before: a traceback from verify (a str compared with token ids) or from inspect."""
    edit(copy, lambda m: m.update(params=params))
    assert_one_line_exit_2(["verify", str(copy)], "manifest.json: params is")


# -- 2. resume only into the same order --------------------------------------------------------------------------------
def started_loader(root: Path, split: str = "train", **kw: Any) -> ShardedLoader:
    ld = ShardedLoader(ShardedDataset(root, split, batch_size=100, world=World(0, 1), **kw))
    it = iter(ld)
    for _ in range(3):
        next(it)
    return ld


@pytest.mark.parametrize("change", [{"window": 8192}, {"window": 1000}, {"window": 40_000}])
def test_resume_in_another_window_reads_the_rest_once(nomlm_dataset: Path, change: dict[str, int]) -> None:
    """Before the window was recorded: resumed with some persons twice and as many missed. Then refused; now the
    rest of the epoch, in the window it was begun in (tests/reader/test_elastic_resume.py has the other layout
    changes)."""
    ld = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1)))
    it = iter(ld)
    trained = [i for _ in range(3) for i in next(it)["person_id"].tolist()]
    state = ld.state_dict()
    del it
    again = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1), **change))
    with pytest.warns(UserWarning, match=r"resumes in another layout \(window 4096 -> "):
        again.load_state_dict(state)
    rest = [i for b in again for i in b["person_id"].tolist()]
    assert len(rest + trained) == len(set(rest + trained))
    everyone, left = trained_ids(nomlm_dataset, 1, 0, 0)  # one reader: the whole split, remainder included
    assert not left and set(rest + trained) == everyone


def test_resume_refuses_another_split(nomlm_dataset: Path) -> None:
    """Before: a val loader went on with train persons from batch 3."""
    state = started_loader(nomlm_dataset).state_dict()
    with pytest.raises(ValueError, match=re.escape(f"{nomlm_dataset}: cannot resume exactly: split ['train'] -> "
                                                   "['val']") + ".*checkpoint's settings, or without the loader's"):
        ShardedLoader(ShardedDataset(nomlm_dataset, "val", batch_size=100, world=World(0, 1))).load_state_dict(state)


def test_resume_refuses_a_state_that_predates_the_window(nomlm_dataset: Path) -> None:
    """An older loader state cannot say which window or split it was read with: refused, not guessed."""
    state = started_loader(nomlm_dataset).state_dict()
    for key in ("split", "window"):
        state["layout"].pop(key, None)
    ld = ShardedLoader(ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1)))
    with pytest.raises(ValueError, match="does not record split, window"):
        ld.load_state_dict(state)


# -- 3. verify checks what the reader relies on -----------------------------------------------------------------------
@pytest.mark.parametrize("block_persons", [8, 32])
def test_verify_checks_block_persons(small_blocks: Path, tmp_path: Path, block_persons: int) -> None:
    """Before: verify said OK, and reading failed on a short block (or with an IndexError deep in numpy)."""
    ds = copy_of(small_blocks, tmp_path)
    edit(ds, lambda m: m.update(block_persons=block_persons))
    code, out = shardify("verify", str(ds))
    needle = f"000000.block.zst: 16 persons, where the manifest's 115 persons in blocks of {block_persons}"
    assert code == 1 and needle in out, out
    with pytest.raises(OSError, match="persons, where the manifest's 115 persons"):
        read_all(ds)


def test_verify_checks_the_format_version(copy: Path) -> None:
    """Before: verify said OK to a format-1 manifest whose schema stores runs."""
    edit(copy, lambda m: m.update(format_version=1))
    needle = "manifest.json: schema: format 1 stores no runs, but run_length, abspos, age, segment are"
    assert_one_line_exit_2(["verify", str(copy)], needle)
    with pytest.raises(ManifestError, match=needle):
        ShardedDataset(copy)


# -- 4. a manifest missing a key: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize(("where", "key", "at"), [
    (("splits", "train", "shards", 0), "file", " in splits.train.shards[0]"),
    (("splits", "val", "shards", 1), "samples", " in splits.val.shards[1]"),
    (("splits", "train"), "remainder", " in splits.train"),
    (("schema", 2), "dtype", " in schema[2]"),
    (("totals",), "tokens", " in totals"),
    ((), "block_persons", " in the manifest"),
])
def test_a_manifest_missing_a_key_is_one_line(copy: Path, where: tuple[Any, ...], key: str, at: str) -> None:
    """Before: KeyError in the reader, a traceback from verify, inspect and plan."""
    def drop(m: ManifestJSON) -> None:
        obj: Any = m
        for k in where:
            obj = obj[k]
        del obj[key]

    edit(copy, drop)
    needle = f"manifest.json: missing key '{key}'{at}"
    with pytest.raises(ManifestError) as err:
        ShardedDataset(copy)
    assert needle in str(err.value)
    for args in (["verify"], ["inspect"], ["plan", "--batch-size", "64"]):
        assert_one_line_exit_2([args[0], str(copy), *args[1:]], needle)


# -- 5. a killed training process takes everything it started along -----------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not SHM.is_dir(), reason="Linux /dev/shm and /proc")
def test_a_killed_training_process_leaves_nothing_behind(nomlm_dataset: Path) -> None:
    """`python train.py | tee log` after an out-of-memory kill: the pipe reaches EOF (no forkserver, worker or
    resource tracker keeps it open), no process of the training's group survives, and its semaphores are gone
    from /dev/shm."""
    env = repo_first(os.environ)
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
        assert wait_for(lambda: not group_pids(proc.pid), 10), f"survivors: {group_pids(proc.pid)}"
        assert wait_for(lambda: not any(p.exists() for p in shm), 10), \
            f"left in /dev/shm: {sorted(p.name for p in shm if p.exists())}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in shm:  # the test's own leftovers only (those its processes had mapped)
            p.unlink(missing_ok=True)


# -- 6. remote transports: what a `pipe:` command or an http(s) server does at the edges ------------------------------
SLOWCAT = """import sys, time
with open(sys.argv[1], "rb") as fh:
    for chunk in iter(lambda: fh.read(2048), b""):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        time.sleep(0.002)
"""


@pytest.mark.timeout(120)
def test_a_pipe_read_that_stops_early_is_not_the_commands_failure(small_blocks: Path, tmp_path: Path) -> None:
    """A window that ends inside a shard reads only its first blocks and closes the stream while the command still
    sends (as `aws s3 cp ... -` does over a network). Before: the command's exit status after that close
    (BrokenPipeError: exit 1; only a shell's 141 was let through) failed the epoch with `exit 1 (read)`."""
    script = tmp_path / "slowcat.py"
    script.write_text(SLOWCAT)
    root = f"pipe:{sys.executable} {script} {small_blocks}/{{}}"
    local = read_all(small_blocks)
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


# -- 7. set_epoch / resume_at outside an epoch -------------------------------------------------------------------------
@pytest.mark.parametrize(("call", "needle"), [
    (lambda ds: ds.resume_at(0, len(ds) + 5), r"cannot resume epoch 0 after 61 batches: this rank's epoch has 56 "
                                              r"\(resume at 0\.\.56, or set_epoch\(1\) for the next\)"),
    (lambda ds: ds.resume_at(2, -1), r"cannot resume epoch 2 after -1 batches"),
    (lambda ds: ds.set_epoch(-1), r"epoch -1: epochs are numbered from 0"),
])
def test_a_position_outside_the_epoch_is_refused(nomlm_dataset: Path, call: Callable[[ShardedDataset], None],
                                                 needle: str) -> None:
    """Before: resuming past the epoch's end gave an empty epoch without a word (num_workers=0; workers failed
    with 'batches consumed, but the workers only produce'), a negative epoch numpy's 'expected non-negative
    integer' at the first batch; now the call refuses, naming the dataset."""
    ds = ShardedDataset(nomlm_dataset, batch_size=100, world=World(0, 1))
    with pytest.raises(ValueError, match=re.escape(str(nomlm_dataset)) + ": " + needle):
        call(ds)
    ds.resume_at(0, len(ds))  # the end of the epoch: nothing left of it
    assert list(ds) == []


@pytest.mark.parametrize(("arg", "value"), [("pad_to", 0), ("pad_to", -8), ("pad_multiple", 0), ("batch_size", 0),
                                            ("batch_size", -1), ("seed", -1), ("window", 0)])
def test_arguments_that_cannot_be_are_refused_at_construction(nomlm_dataset: Path, arg: str, value: int) -> None:
    """Before: pad_to=0 gave batches of persons cropped to no tokens, without a word; the others failed at the first
    batch, in a worker (a ZeroDivisionError, numpy's 'expected non-negative integer') or in ShardedLoader."""
    with pytest.raises(ValueError, match=rf"^{arg} must be an integer >= [01], not {value}$"):
        ShardedDataset(nomlm_dataset, world=World(0, 1), **{arg: value})
