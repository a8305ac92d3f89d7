"""Array conversion (`convert --task I --tasks K`, or SLURM's array variables) and `shardify merge`: the tasks run
as real processes, as a SLURM array runs them, and the merged dataset is the single conversion's, byte for byte."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import repo_first, scaled, shardify, wait_for
from small_inputs import assert_refused, hooked

from lifeseq_shards.convert.array import share_from
from lifeseq_shards.convert.outdir import TASKS
from lifeseq_shards.convert.passes import ConvertError, Share
from lifeseq_shards.convert.sources.synth import synth_population

OPTS = ("--min-shard-persons", 100, "--all")  # the sample's persons in about 50 shards a split: several a task


def _slurm(task: int, count: int, first: int = 0) -> dict[str, str]:
    """The variables SLURM sets in task ``task`` of `sbatch --array=FIRST-LAST` (ids FIRST..FIRST+count-1)."""
    return {"SLURM_JOB_ID": str(1000 + task), "SLURM_ARRAY_JOB_ID": "999", "SLURM_ARRAY_TASK_ID": str(first + task),
            "SLURM_ARRAY_TASK_MIN": str(first), "SLURM_ARRAY_TASK_MAX": str(first + count - 1),
            "SLURM_ARRAY_TASK_COUNT": str(count), "SLURM_ARRAY_TASK_STEP": "1"}


def _shardify_env(env: dict[str, str], *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lifeseq_shards.cli", *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=repo_first({**os.environ, **env}))


def _array(inputs: list[object], out: Path, k: int, first: int = 0, *opts: object) -> list[str]:
    """Run the K tasks at once as separate processes with SLURM's variables (no --task/--tasks); their stdout."""
    procs = [_shardify_env(_slurm(i, k, first), "convert", *inputs, "-o", out, *OPTS, *opts) for i in range(k)]
    outs = [p.communicate(timeout=scaled(240)) for p in procs]
    for p, (_, e) in zip(procs, outs, strict=True):
        assert p.returncode == 0, e
    return [o for o, _ in outs]


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the dataset but the lock: its shards, lengths indexes and manifest (without its time)."""
    got = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
           and p.name != ".conversion.lock"}
    m = json.loads(got.pop("manifest.json"))
    m["params"].pop("seconds")
    got["manifest.json"] = json.dumps(m).encode()
    return got


@pytest.fixture(scope="module")
def synth_input(tmp_path_factory: pytest.TempPathFactory) -> list[object]:
    raw = tmp_path_factory.mktemp("synth")
    synth_population(raw, 3000, 5)
    return [raw / "sequences.parquet", "--vocab", raw / "vocab.csv"]


@pytest.fixture(scope="module")
def sample_input(sample: Path) -> list[object]:
    return [sample / "sequences.parquet", "--vocab", sample / "vocab.csv"]


@pytest.fixture(scope="module")
def singles(sample_input: list[object], synth_input: list[object],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """The single-process conversion of each input: what every array's merge must equal."""
    out = {}
    for name, inputs in (("sample", sample_input), ("synth", synth_input)):
        root = tmp_path_factory.mktemp(name) / "ds"
        code, text = shardify("convert", *inputs, "-o", root, *OPTS)
        assert code == 0, text
        out[name] = _files(root)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("which", ["sample", "synth"])
def test_array_tasks_merge_into_the_single_conversion(which: str, k: int, request: pytest.FixtureRequest,
                                                      singles: dict[str, dict[str, bytes]], tmp_path: Path) -> None:
    """K tasks with SLURM's variables (ids from 1, as `--array=1-K`), run at once, then merged: the same files,
    byte for byte, as one process converting it all (shards, lengths indexes, manifest and its fingerprint); each
    task says which share it converted; a second merge does nothing and leaves the dataset as it is."""
    inputs = request.getfixturevalue(f"{which}_input")
    outs = _array(inputs, tmp_path / "ds", k, 1)
    assert all(f"task {i} of {k} (SLURM_ARRAY_TASK_ID={i + 1} of 1..{k}) converted" in o for i, o in enumerate(outs))
    merge = _shardify_env({}, "merge", tmp_path / "ds")
    text, err = merge.communicate(timeout=scaled(120))
    assert merge.returncode == 0, err
    got = _files(tmp_path / "ds")
    assert got.keys() == singles[which].keys()
    assert got == singles[which]
    assert not (tmp_path / "ds" / TASKS).exists()
    code, again = shardify("merge", tmp_path / "ds")
    assert code == 0 and "already merged" in again, again
    assert _files(tmp_path / "ds") == got
    code, text = shardify("verify", tmp_path / "ds")
    assert code == 0, text


@pytest.mark.parametrize("k", [2, 3])
def test_each_task_encodes_only_the_persons_of_its_shards(k: int, synth_input: list[object], tmp_path: Path) -> None:
    """An array task surveys everyone (ids and lengths) but tokenises only the persons its own shards hold: the
    count each task records is its part's persons, less than all, and the tasks' counts add up to the dataset's
    (every person encoded once, by one task). A task that encoded the whole input fails the first and the last."""
    out = tmp_path / "ds"
    for i in range(k):
        code, text = shardify("convert", *synth_input, "-o", out, "--min-shard-persons", 100, "--task", i, "--tasks",
                              k)
        assert code == 0, text
    encoded, held = [], []
    for i in range(k):
        part = out / TASKS / f"task-{i:04d}-of-{k:04d}"
        encoded.append(json.loads((part / "task.json").read_text())["encoded"])
        splits = json.loads((part / "manifest.json").read_text())["splits"].values()
        held.append(sum(e["samples"] for s in splits for e in [*s["shards"], *([s["remainder"]] if s["remainder"]
                                                                                else [])]))
    persons = json.loads((out / TASKS / f"task-0000-of-{k:04d}" / "manifest.json").read_text())["totals"]["persons"]
    assert encoded == held
    assert max(encoded) < persons
    assert sum(encoded) == persons


KILL_IN_PASS2 = """
import lifeseq_shards.convert.writers as w
write = w._write_shard_job
def stall(args):
    out = write(args)
    (report / "wrote").touch()
    time.sleep(120)
    return out
w._write_shard_job = stall
"""


@pytest.mark.timeout(240)
def test_a_task_killed_half_way_is_not_complete_and_its_rerun_completes(sample_input: list[object],
                                                                       singles: dict[str, dict[str, bytes]],
                                                                       tmp_path: Path) -> None:
    """SIGKILL of task 1 of 2 after it wrote a shard: it leaves no part that looks finished, the merge names it,
    its rerun clears what it left and completes; task 0, complete, is not redone when run again."""
    out = tmp_path / "ds"
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 2)
    assert code == 0, text
    done0 = out / TASKS / "task-0000-of-0002"
    stamp = (done0 / "manifest.json").stat().st_mtime_ns
    proc = hooked(KILL_IN_PASS2, tmp_path / "report", "convert", *sample_input, "-o", out, *OPTS, "--task", 1,
                  "--tasks", 2)
    try:
        assert wait_for(lambda: (tmp_path / "report" / "wrote").exists(), 120), proc.stderr
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    staging = out / TASKS / ".task-0001-of-0002.staging"
    assert list(staging.rglob("shard-*.tar")), "killed before it wrote a shard"
    assert not (out / TASKS / "task-0001-of-0002").exists()
    assert_refused(*shardify("merge", out), "task 1 of 2 not complete", "still running or killed",
                   "submit the array again")
    assert not (out / "manifest.json").exists()
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 1, "--tasks", 2)
    assert code == 0 and "task 1 of 2 (--task 1 --tasks 2) converted" in text, text
    assert not staging.exists()
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 2)
    assert code == 0 and "already complete with these options, not converted again" in text, text
    assert (done0 / "manifest.json").stat().st_mtime_ns == stamp
    code, text = shardify("merge", out)
    assert code == 0, text
    assert _files(out) == singles["sample"]


def test_merge_refuses_missing_tasks(sample_input: list[object], tmp_path: Path) -> None:
    """Only task 0 of 3 complete: the merge names the other two and writes nothing; no task at all, or no tasks
    directory, are refused too."""
    out = tmp_path / "ds"
    assert_refused(*shardify("merge", out), f"{out}: no array tasks to merge")
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 3)
    assert code == 0, text
    assert_refused(*shardify("merge", out), f"{out}: tasks 1, 2 of 3 not complete", "--tasks 3")
    assert not (out / "manifest.json").exists() and (out / TASKS / "task-0000-of-0003").is_dir()


def test_merge_refuses_tasks_with_other_options(sample_input: list[object], tmp_path: Path) -> None:
    """Task 1 converted with another seed than task 0: the merge names task 1 and the option, and writes nothing."""
    out = tmp_path / "ds"
    for task, seed in ((0, 0), (1, 3)):
        code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--seed", seed, "--task", task, "--tasks", 2)
        assert code == 0, text
    assert_refused(*shardify("merge", out), "task 1 of 2 was not made like task 0 (seed 0, here 3)")
    assert not (out / "manifest.json").exists()


def test_merge_refuses_tasks_of_other_input(tmp_path: Path) -> None:
    """The input file replaced between the tasks (same path, other persons): the merge names task 1 and says the
    input differs."""
    raw, out = tmp_path / "raw", tmp_path / "ds"
    inputs = [raw / "sequences.parquet", "--vocab", raw / "vocab.csv"]
    for task, seed in ((0, 1), (1, 2)):
        synth_population(raw, 800, seed)
        code, text = shardify("convert", *inputs, "-o", out, "--min-shard-persons", 50, "--task", task, "--tasks", 2)
        assert code == 0, text
    assert_refused(*shardify("merge", out), "task 1 of 2 was not made like task 0 (other input")


def test_a_complete_task_with_other_options_or_another_count_is_refused(sample_input: list[object],
                                                                         tmp_path: Path) -> None:
    """A task run again with other options than its complete part is refused (--overwrite converts it again); a
    task of another --tasks than the parts there is refused."""
    out = tmp_path / "ds"
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 2)
    assert code == 0, text
    assert_refused(*shardify("convert", *sample_input, "-o", out, *OPTS, "--seed", 4, "--task", 0, "--tasks", 2),
                   "task-0000-of-0002: complete, made with other options (seed 0, here 4)")
    assert_refused(*shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 1, "--tasks", 3),
                   "holds parts of --tasks 2, not 3")
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--seed", 4, "--task", 0, "--tasks", 2,
                          "--overwrite")
    assert code == 0 and "converted" in text and "already" not in text, text
    part = json.loads((out / TASKS / "task-0000-of-0002" / "manifest.json").read_text())
    assert part["params"]["seed"] == 4


def test_a_merged_dataset_refuses_new_tasks_without_overwrite(sample_input: list[object], tmp_path: Path) -> None:
    out = tmp_path / "ds"
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 1)
    assert code == 0, text
    code, text = shardify("merge", out)
    assert code == 0, text
    assert_refused(*shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 1),
                   "already holds a dataset")


def test_a_merge_stopped_before_removing_the_parts_is_finished_by_the_next(sample_input: list[object],
                                                                          tmp_path: Path) -> None:
    """Killed after the manifest was placed, before the parts went: the next merge sees the dataset is the parts'
    and only removes them (without --overwrite)."""
    out = tmp_path / "ds"
    code, text = shardify("convert", *sample_input, "-o", out, *OPTS, "--task", 0, "--tasks", 1)
    assert code == 0, text
    kept = tmp_path / "parts"
    shutil.copytree(out / TASKS, kept)
    code, text = shardify("merge", out)
    assert code == 0, text
    shutil.copytree(kept, out / TASKS)
    code, text = shardify("merge", out)
    assert code == 0 and "already merged" in text, text
    assert not (out / TASKS).exists()


@pytest.mark.parametrize(("env", "task", "tasks", "want"), [
    ({}, None, None, None),
    ({}, 2, 5, Share(2, 5)),
    (_slurm(3, 4), None, None, Share(3, 4)),
    (_slurm(0, 4, first=7), None, None, Share(0, 4)),
    (_slurm(3, 4), 1, 2, Share(1, 2)),  # given options win over the array's variables
])
def test_which_share(env: dict[str, str], task: int | None, tasks: int | None, want: Share | None) -> None:
    assert share_from(task, tasks, env)[0] == want


@pytest.mark.parametrize(("env", "task", "tasks", "needle"), [
    ({}, 1, None, "give both --task and --tasks"),
    ({}, None, 3, "give both --task and --tasks"),
    ({}, 3, 3, "--task 3: outside 0..2"),
    ({**_slurm(2, 6), "SLURM_ARRAY_TASK_MAX": "10"}, None, None, "ids 0..10 hold 6 tasks (a stepped or listed"),
    ({"SLURM_ARRAY_TASK_ID": "2"}, None, None, "SLURM_ARRAY_TASK_MIN=(unset)"),
])
def test_ambiguous_shares_are_refused(env: dict[str, str], task: int | None, tasks: int | None, needle: str) -> None:
    with pytest.raises(ConvertError) as e:
        share_from(task, tasks, env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _guide_files() -> dict[str, str]:
    """docs/guides/convert.md's scripts (its `file` blocks) by name."""
    from test_docs import GUIDES, parse

    return {b.file: b.code for b in parse(GUIDES / "convert.md").blocks if b.file}


def _single_like(script: str, tmp_path: Path) -> Path:
    """The dataset one `shardify convert` makes with the array script's own options (into tmp_path/single)."""
    from doc_checks import commands

    (convert,) = [c for c in commands(script) if c[:2] == ["shardify", "convert"]]
    words = [w.replace("ds_array/", str(tmp_path / "single")).replace("$SLURM_CPUS_PER_TASK", "1") for w in convert[2:]]
    code, text = shardify("convert", *[str(tmp_path / w) if w in ("sequences.parquet", "vocab.csv") else w
                                       for w in words])
    assert code == 0, text
    return tmp_path / "single"


def test_the_guides_array_job_runs_with_slurms_variables(sample: Path, tmp_path: Path) -> None:
    """docs/guides/convert.md's array script, run as each task of its `#SBATCH --array` with the variables SLURM
    sets, then its merge script: the dataset of one `shardify convert` with the script's options."""
    from doc_checks import env

    files = _guide_files()
    script, merge = files["convert-array.sh"], files["merge.sh"]
    array = re.search(r"^#SBATCH --array=(\d+)-(\d+)$", script, re.M)
    assert array, "the guide's array script has no #SBATCH --array=FIRST-LAST"
    first, last = int(array.group(1)), int(array.group(2))
    for name in ("sequences.parquet", "vocab.csv"):
        (tmp_path / name).symlink_to(sample / name)
    (tmp_path / "convert-array.sh").write_text(script)
    (tmp_path / "merge.sh").write_text(merge)
    for i in range(last - first + 1):
        slurm = {**_slurm(i, last - first + 1, first), "SLURM_CPUS_PER_TASK": "1"}
        r = subprocess.run(["bash", "-euo", "pipefail", "convert-array.sh"], cwd=tmp_path, env={**env(), **slurm},
                           capture_output=True, text=True, timeout=scaled(240))
        assert r.returncode == 0 and f"task {i} of {last - first + 1}" in r.stdout, r.stderr
    r = subprocess.run(["bash", "-euo", "pipefail", "merge.sh"], cwd=tmp_path, env=env(), capture_output=True,
                       text=True, timeout=scaled(240))
    assert r.returncode == 0 and "ds_array/: OK" in r.stdout, r.stdout + r.stderr
    assert _files(tmp_path / "ds_array") == _files(_single_like(files["convert-array.sh"], tmp_path))


def _slurm_up() -> bool:
    """A SLURM controller answers here (a single-node SLURM from Debian's packages; CI has none). Asked when the test
    runs, not when it is collected: sinfo takes seconds to give up on a controller that is not there."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=scaled(30))
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and "up" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_guides_scripts_under_a_real_slurm(sample: Path, tmp_path: Path) -> None:
    """The guide's array and merge scripts submitted as the guide says (`--dependency=afterok`) to a real SLURM: the
    merge job verifies the dataset, which is the single conversion's. Only the CPUs and memory a task asks for are
    overridden on the command line (a test node has fewer than the guide's 16 CPUs and 32 GB)."""
    from doc_checks import env

    if not _slurm_up():
        pytest.skip("needs a running SLURM (sbatch, sinfo)")
    files = _guide_files()
    for name in ("sequences.parquet", "vocab.csv"):
        (tmp_path / name).symlink_to(sample / name)
    for name in ("convert-array.sh", "merge.sh"):
        (tmp_path / name).write_text(files[name])
    submit = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=1", "--mem=500M", "convert-array.sh"],
                            cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=scaled(60), check=True)
    array = submit.stdout.strip().split(";")[0]
    merge = subprocess.run(["sbatch", "--wait", f"--dependency=afterok:{array}", "--mem=500M", "merge.sh"],
                           cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=scaled(540))
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("slurm-*.out")))
    assert merge.returncode == 0, logs
    assert "ds_array/: OK" in logs and "SLURM_ARRAY_TASK_ID=3 of 0..3" in logs, logs
    assert _files(tmp_path / "ds_array") == _files(_single_like(files["convert-array.sh"], tmp_path))
