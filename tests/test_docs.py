"""Every fenced bash and python block of the task guides (docs/guides/*.md) and of the README, run as a researcher
would run it, top to bottom, in a directory holding the researchers' sample files.

A guide marks a block with an HTML comment on the line before its fence, ``<!-- doc-test: DIRECTIVE; ... -->``:

- ``file NAME``: the block is the file NAME (a script a later block runs), written into the guide's directory;
- ``needs gpu`` / ``needs slurm`` / ``needs their-repo`` / ``needs old-data``: not run here, checked instead: every
  command's program and flags exist (``shardify`` subcommands and options, ``python -m tools.X --help``,
  torchrun's parser, a ``make`` target, a diff that ``git apply --stat`` reads and whose ``lifeseq_shards`` imports
  resolve), every import of a python block resolves and every keyword it passes to a class or function it imports
  is one that callable takes;
- ``runs-in PATH``: run by that test (or Makefile), which must name the guide or the block's commands; checked too;
- on a line of its own, ``after GUIDE``: the guide starts in a copy of GUIDE's directory once GUIDE has run.

Runs on small data (the sample: 6,000 persons), with a few named edits that make a training script tiny
(``TINY``): each edit's text must be in the guide, so a guide that changes fails here instead of going untested.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.dataset
import pytest
from doc_checks import BLOCK_S, check_command, check_diff, check_python, check_shardify, commands, env, run
from helpers import REPO, wait_for

from lifeseq_shards.store.remote import read_manifest

GUIDES = REPO / "docs" / "guides"
PAGES = [*sorted(GUIDES.glob("*.md")), REPO / "README.md"]
SAMPLE_FILES = ("sequences.parquet", "vocab.csv", "encoded_nomlm.h5", "encoded_mlm.h5")
NEEDS = {"gpu", "slurm", "their-repo", "old-data"}

# guide -> (text in the guide, what the test runs instead): a training run small enough for a CPU, in the main
# process (the loader's workers, their forkserver and rings run in tests/reader/test_reader.py,
# tests/reader/test_ddp.py and others)
TINY: dict[str, list[tuple[str, str]]] = {
    "train-lightning.md": [
        # the guide's own CPU branch and batch, 4 steps instead of 40 and a model small enough that embed.md's
        # two predicts of every person fit their block's time on a 2-core machine shared with other jobs (the
        # guide's CPU model took 102 s of CPU time and 1.4 GB for its 40 steps, as the guide says)
        ("EncoderConfig(64, 256, 2, 4), 1, 32, 40", "EncoderConfig(32, 64, 1, 2), 1, 32, 4"),
        ("num_workers=2", "num_workers=0"),  # workers start in a second each, minutes under load: other tests
    ],
    "embed.md": [("num_workers=2", "num_workers=0")],
}

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- doc-test: (.*?) -->")


@dataclass
class Block:
    lang: str
    code: str
    line: int
    file: str | None = None
    needs: set[str] = field(default_factory=set)
    runs_in: str | None = None

    def where(self, page: Path) -> str:
        return f"{page.relative_to(REPO)}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    after: str | None


def parse(path: Path) -> Page:
    """The page's bash and python blocks with their directives, and the guide it starts after."""
    text = path.read_text()
    blocks, after = [], None
    for m in MARK.finditer(text):
        for directive in m.group(1).split(";"):
            if directive.strip().startswith("after "):
                after = directive.split()[1]
    for m in FENCE.finditer(text):
        lang = m.group(1)
        if lang not in ("bash", "python"):
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        block = Block(lang, m.group(2), text[: m.start()].count("\n") + 1)
        mark = MARK.fullmatch(before.strip())
        for directive in (mark.group(1).split(";") if mark else []):
            verb, _, arg = directive.strip().partition(" ")
            if verb == "file":
                block.file = arg
            elif verb == "needs":
                assert arg in NEEDS, f"{block.where(path)}: needs {arg!r}, not one of {sorted(NEEDS)}"
                block.needs.add(arg)
            elif verb == "runs-in":
                block.runs_in = arg
            else:
                raise AssertionError(f"{block.where(path)}: unknown doc-test directive {directive!r}")
        blocks.append(block)
    return Page(path, blocks, after)


def check_runs_in(page: Path, block: Block) -> None:
    """The named test (or Makefile) exists and names this guide or every command of the block."""
    other = REPO / str(block.runs_in)
    assert other.is_file(), f"{block.where(page)}: runs-in {block.runs_in}: no such file"
    text = other.read_text()
    if page.name in text:
        return
    wanted = [" ".join(words[:2]) for words in commands(block.code)] if block.lang == "bash" else [block.code]
    missing = [w for w in wanted if w not in text]
    assert not missing, f"{block.where(page)}: {block.runs_in} names neither {page.name} nor {missing}"


def check(page: Path, block: Block, cwd: Path) -> None:
    where = block.where(page)
    if block.lang == "python":
        check_python(block.code, cwd, where)
    else:
        for words in commands(block.code):
            check_command(words, cwd, where)


# -- running a page -------------------------------------------------------------------------------------------
def edited(page: Path, code: str) -> str:
    """``code`` with the page's ``TINY`` edits."""
    for old, new in TINY.get(page.name, []):
        code = code.replace(old, new)
    return code


def run_block(page: Path, block: Block, i: int, cwd: Path) -> None:
    code = edited(page, block.code)
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        script = cwd / f"_block{i}.py"
        script.write_text(code)
        cmd = [sys.executable, script.name]
    r = run(cmd, cwd)
    assert r.returncode == 0, f"{block.where(page)} exited {r.returncode}:\n{code}\n{(r.stdout + r.stderr)[-4000:]}"


@dataclass
class Session:
    """Where each page ran: a researcher's directory of the sample files, one per page."""

    root: Path
    sample: Path
    dirs: dict[str, Path] = field(default_factory=dict)

    def page_dir(self, name: str) -> Path:
        """The directory page ``name`` ran in (running it, and the guide it starts after, first)."""
        if name in self.dirs:
            return self.dirs[name]
        path = GUIDES / name if (GUIDES / name).exists() else REPO / name
        page = parse(path)
        cwd = self.root / name.removesuffix(".md")
        if page.after:
            shutil.copytree(self.page_dir(page.after), cwd, symlinks=True)
        else:
            cwd.mkdir()
            for f in SAMPLE_FILES:
                (cwd / f).symlink_to(self.sample / f)
        for i, block in enumerate(page.blocks):
            if block.file:
                (cwd / block.file).write_text(edited(path, block.code))
            if block.runs_in:
                check_runs_in(path, block)
            if block.needs or block.runs_in or block.file:  # a file is run by a later block
                check(path, block, cwd)
            else:
                run_block(path, block, i, cwd)
        self.dirs[name] = cwd
        return cwd


@pytest.fixture(scope="module")
def session(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Session:
    return Session(tmp_path_factory.mktemp("guides"), sample)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs(page: Path, session: Session) -> None:
    """The page's blocks, in order, in a directory of its own: each runs with exit 0, or is checked."""
    start = time.monotonic()
    session.page_dir(page.name)
    print(f"{page.name}: {time.monotonic() - start:.1f} s")


# each rank's EmbeddingWriter.write sleeps after writing (a sitecustomize on the ranks' PYTHONPATH; the script stays
# the guide's, byte for byte), and records its process group, so that a kill lands while the job is under way and
# reaches every rank (torchrun starts each rank in a process group of its own)
SLOW_WRITES = """
import os
import time

if "LOCAL_RANK" in os.environ:
    from lifeseq_shards.embed.writer import EmbeddingWriter

    with open(os.path.join(os.path.dirname(__file__), f"pgid-{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpgid(0)))
    _write = EmbeddingWriter.write

    def write(self, *args, **kwargs):
        _write(self, *args, **kwargs)
        time.sleep(0.5)

    EmbeddingWriter.write = write
"""
EMBED_LOOP = ["torchrun", "--standalone", "--nproc_per_node=2", "embed_loop.py"]


def embeddings(out: Path) -> dict[str, np.ndarray]:
    table = pyarrow.dataset.dataset(out).to_table().sort_by("person_id")
    return {"person_id": table.column("person_id").to_numpy(),
            **{f: np.stack(table.column(f).to_numpy(zero_copy_only=False)) for f in ("cls", "mean")}}


@pytest.mark.slow
@pytest.mark.timeout(3 * BLOCK_S + 300)
def test_embed_loop_killed_under_torchrun_resumes_on_two_ranks(session: Session, tmp_path: Path) -> None:
    """embed.md's plain-loop script as written (2 loader workers a rank), under torchrun on 2 ranks: SIGKILLed
    (torchrun and every rank) once some shards are written, started again on 2 ranks, it reads only the shards left
    and leaves the finished ones as they were; the output verifies and holds the embeddings of the guide's own
    uninterrupted run."""
    guide = session.page_dir("embed.md")
    (script,) = [b.code for b in parse(GUIDES / "embed.md").blocks if b.file == "embed_loop.py"]
    cwd, slow = tmp_path / "job", tmp_path / "slow"
    cwd.mkdir(), slow.mkdir()
    (cwd / "embed_loop.py").write_text(script)
    for name in ("ds", "checkpoints"):
        (cwd / name).symlink_to(guide / name)
    (slow / "sitecustomize.py").write_text(SLOW_WRITES)
    slowed = {**env(), "PYTHONPATH": os.pathsep.join([str(slow), env()["PYTHONPATH"]])}
    out = cwd / "emb_loop"

    def finished() -> dict[str, int]:
        return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*.parquet")}

    with open(tmp_path / "killed.log", "w") as log:
        job = subprocess.Popen(EMBED_LOOP, cwd=cwd, env=slowed, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        assert wait_for(lambda: len(finished()) >= 2 or job.poll() is not None, BLOCK_S)
    finally:
        for group in [job.pid, *(int(p.read_text()) for p in slow.glob("pgid-*"))]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        job.wait()
    assert job.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-4000:]
    before = finished()
    total = len(list(read_manifest(cwd / "ds").entries()))
    assert 2 <= len(before) < total, before
    r = run(["shardify", "embeddings", "verify", "emb_loop/", "--data", "ds/"], cwd)
    assert r.returncode == 1 and "missing" in r.stdout + r.stderr, r.stdout + r.stderr

    r = run(EMBED_LOOP, cwd)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    said = f"EmbeddingWriter emb_loop: {len(before)} of {total} shards done, reading {total - len(before)}"
    assert said in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]
    assert {name: finished()[name] for name in before} == before  # not written again
    r = run(["shardify", "embeddings", "verify", "emb_loop/", "--data", "ds/"], cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = embeddings(out), embeddings(guide / "emb_loop")
    np.testing.assert_array_equal(got["person_id"], want["person_id"])
    for field_name in ("cls", "mean"):  # float16; batches are cut otherwise after a resume
        np.testing.assert_allclose(got[field_name].astype(np.float32), want[field_name].astype(np.float32),
                                   rtol=1e-2, atol=1e-3)


# stand-ins for Slurm's programs: srun exits with the ranks' status (RANKS, else it runs until SIGTERM and exits
# 143, as StopOnSigterm ends the ranks), scontrol writes down what it was asked
SRUN = """#!/bin/bash
trap 'exit 143' TERM
touch "$OUT/started"
[ -n "${RANKS:-}" ] && exit "$RANKS"
sleep 60 & wait
"""
SCONTROL = """#!/bin/bash
echo "$@" >> "$OUT/scontrol"
"""


def test_the_job_script_requeues_a_job_stopped_by_sigterm_and_only_it(tmp_path: Path) -> None:
    """resume.md's job script (srun and scontrol stood in for): the ranks' 143 is requeued and the job ends 143; 0
    and 1 are not requeued and end as they are; the same SIGTERM to the batch shell, its srun and the ranks (as
    Slurm sends it) still requeues."""
    (script,) = [b.code for b in parse(GUIDES / "resume.md").blocks if b.file == "requeue.sh"]
    (tmp_path / "requeue.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def job(ranks: int | None) -> tuple[int, str]:
        out = tmp_path / f"out-{ranks}"
        out.mkdir()
        job_env = {**env(), "PATH": os.pathsep.join([str(bin_dir), env()["PATH"]]), "SLURM_JOB_ID": "4242",
                   "OUT": str(out), **({"RANKS": str(ranks)} if ranks is not None else {})}
        proc = subprocess.Popen(["bash", "requeue.sh"], cwd=tmp_path, env=job_env, start_new_session=True)
        try:
            if ranks is None:
                assert wait_for(lambda: (out / "started").exists(), 30)
                os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        return code, (out / "scontrol").read_text() if (out / "scontrol").exists() else ""

    assert job(0) == (0, "")
    assert job(1) == (1, "")
    assert job(143) == (143, "requeue 4242\n")
    assert job(None) == (143, "requeue 4242\n")


def test_every_guide_has_blocks_and_every_edit_applies() -> None:
    """A guide without a block tests nothing; an edit whose text left its guide would silently run the real size."""
    for path in GUIDES.glob("*.md"):
        assert parse(path).blocks, f"{path.name}: no bash or python block"
    for name, edits in TINY.items():
        text = (GUIDES / name).read_text()
        assert all(old in text for old, _ in edits), f"{name}: an edit's text is no longer in the guide"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """Each static check fails on the mistake it exists for: an unknown option, subcommand or keyword, a missing
    required option (convert's -o; plan's --batch-size is required only without --tokens-per-batch, which the
    command itself checks), a missing script, a diff git cannot read."""
    for bad in (["convert", "x.h5", "-o", "d", "--gpu", "2"], ["convert", "x.h5"], ["embeddings", "show", "e"]):
        with pytest.raises(AssertionError):
            check_shardify(bad)
    check_shardify(["plan", "d", "--batch-size", "8", "--resume", "c.ckpt"])
    # a job id taken from a command (`array=$(sbatch --parsable x.sh)`) is that command, checked as any other
    assert commands("array=$(sbatch --parsable x.sh)\nsbatch --dependency=afterok:$array y.sh") == [
        ["sbatch", "--parsable", "x.sh"], ["sbatch", "--dependency=afterok:$array", "y.sh"]]
    with pytest.raises(AssertionError, match="takes no keyword"):
        check_python("from lifeseq_shards import LifeSeqData\nLifeSeqData('ds/', batch=4)", tmp_path)
    check_python("from lifeseq_shards import LifeSeqData\nLifeSeqData('ds/', pad_to=4, device='cpu')", tmp_path)
    with pytest.raises(AssertionError, match="no such file"):
        check_command(["torchrun", "--standalone", "--nproc_per_node=2", "train.py"], tmp_path, "here")
    (tmp_path / "bad.diff").write_text("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-a\n+from lifeseq_shards import Nope\n")
    with pytest.raises(AssertionError):
        check_diff(tmp_path / "bad.diff")


# -- the pages around the guides ----------------------------------------------------------------------------------
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_every_link_of_the_docs_resolves() -> None:
    """Each relative link of the README, the changelog and docs/ names a file (and heading) that exists."""
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, broken


def test_cli_reference_names_every_command_and_option() -> None:
    """docs/reference/cli.md has a heading per command and names each of its options."""
    import click

    from lifeseq_shards.cli import main

    text = (REPO / "docs" / "reference" / "cli.md").read_text()
    headings = re.findall(r"^## `(shardify [a-z ]+)", text, re.M)
    missing = []

    def walk(command: click.Command, name: str) -> None:
        if isinstance(command, click.Group):
            for sub_name, sub in command.commands.items():
                walk(sub, f"{name} {sub_name}")
            return
        if not any(h.strip() == name for h in headings):
            missing.append(name)
        missing.extend(f"{name} {o}" for p in command.params if isinstance(p, click.Option)
                       for o in p.opts if o.startswith("--") and f"`{o}" not in text)

    walk(main, "shardify")
    assert not missing, missing


@pytest.mark.slow
def test_demo_says_what_a_correct_run_shows(session: Session, capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo`'s last step labels its numbers with what a correct run shows, and on the sample the numbers are
    those: the seed's 80/10/10 rule per person (floor(0.1 n) kept and random, the rest [MASK]) and about 10 % of the
    persons in the CLS task."""
    from tools.demo_batches import main

    main(str(session.page_dir("convert.md") / "ds"), batches=3, workers=0)
    out = capsys.readouterr().out
    assert "batches per epoch on this rank" in out and "BERT's 80/10/10 rule" in out
    for got, want in re.findall(r"MLM targets: ([\d,]*\d) +\(floor\(0\.3 x length\) a person: expect ([\d,]*\d)", out):
        assert got == want
    summary = re.search(r"\[MASK\] ([\d.]+) %.*kept ([\d.]+) %.*random ([\d.]+) %.*shuffled ([\d.]+) %", out)
    assert summary is not None, out
    masked, kept, random, cls = map(float, summary.groups())
    assert 80 <= masked <= 83 and 8 <= kept <= 10 and 8 <= random <= 10 and 3 <= cls <= 20, out
