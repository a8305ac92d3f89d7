"""The reference pages, the guides, the README and docs/architecture.md name only what exists: every
``from lifeseq_shards... import ...`` and every dotted ``lifeseq_shards.x.y`` they write imports, every
``lifeseq_shards/``, ``tests/`` or ``tools/`` file they name is there; the reference
pages' python snippets run (on the CPU; those marked ``<!-- doc-test: needs gpu -->`` are checked as tests/test_docs.py
checks a guide's); and every results page names the commit it measured. tests/test_docs.py runs the guides."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from doc_checks import check_python
from helpers import REPO

REFERENCE = sorted((REPO / "docs" / "reference").glob("*.md"))
SNIPPETS = [p for p in REFERENCE if "```python" in p.read_text()]
PAGES = [*REFERENCE, *sorted((REPO / "docs" / "guides").glob("*.md")), REPO / "README.md",
         REPO / "docs" / "architecture.md"]
RESULTS = sorted((REPO / "docs" / "results").rglob("*.md"))

FROM_IMPORT = re.compile(r"from (lifeseq_shards[\w.]*) import (\([^)]*\)|[^\n`|#]+)")
DOTTED = re.compile(r"\blifeseq_shards(?:\.[A-Za-z_]\w*)+")
# dotted words of the pages that are not Python names
NOT_NAMES = {"lifeseq_shards.embedding": "the key of an embedding file's stamp in its Parquet metadata"}
PATH = re.compile(r"\b((?:lifeseq_shards|tests|tools)/[\w/]+\.py)\b")
COMMIT = re.compile(r"\b(?:commit|at)\s+`?([0-9a-f]{7,40})\b")


def line_of(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def named(page: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every lifeseq_shards name ``page`` imports or mentions."""
    text = page.read_text()
    out = []
    for m in FROM_IMPORT.finditer(text):
        for alias in m.group(2).strip("() \n").split(","):
            name = alias.split(" as ")[0].strip()
            if name:
                out.append((line_of(text, m.start()), f"{m.group(1)}.{name}"))
    out += [(line_of(text, m.start()), m.group(0)) for m in DOTTED.finditer(text) if m.group(0) not in NOT_NAMES]
    return out


def lookup(dotted: str) -> Any:
    """The object ``dotted`` names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):  # a module that exists failed to import
                raise
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_name_a_page_uses_exists(page: Path) -> None:
    found = named(page)
    wrong = []
    for line, dotted in found:
        try:
            lookup(dotted)
        except (ImportError, AttributeError) as e:
            wrong.append(f"{page.relative_to(REPO)}:{line}: {dotted} ({type(e).__name__}: {e})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_page_names_exists(page: Path) -> None:
    """Files named as removed (``tools/x.py at abc1234, removed later``) aside."""
    text = page.read_text()
    missing = [f"{page.relative_to(REPO)}:{line_of(text, m.start())}: {m.group(1)}" for m in PATH.finditer(text)
               if not (REPO / m.group(1)).exists() and "removed" not in text[m.end():m.end() + 40]]
    assert not missing, "\n".join(missing)


def test_a_wrong_name_is_found(tmp_path: Path) -> None:
    """An import of a name a module lacks, a module that does not exist, and a dotted mention of either are found;
    a name that exists is not."""
    page = tmp_path / "page.md"
    page.write_text("```python\nfrom lifeseq_shards.device import BatchBuilder, to_device\n```\n"
                    "See `lifeseq_shards.remote.read_manifest` and `lifeseq_shards.store.remote.read_manifest`.\n")
    bad = []
    for _, dotted in named(page):
        try:
            lookup(dotted)
        except (ImportError, AttributeError):
            bad.append(dotted)
    assert bad == ["lifeseq_shards.device.BatchBuilder", "lifeseq_shards.device.to_device",
                   "lifeseq_shards.remote.read_manifest"]


SIGNATURE = re.compile(r"^\| `((?:lifeseq_shards\.[\w.]+\.)?[A-Z]\w*)\(([^`]*)\)`", re.M)


def test_the_written_signatures_are_the_real_ones() -> None:
    """Every whole signature that starts a row of python-api.md's tables (one without ``...``; names relative to its
    section's module) has the callable's parameters, in order, with its defaults: an argument added to a class is
    added to the page."""
    import inspect

    text = (REPO / "docs" / "reference" / "python-api.md").read_text()
    checked, wrong = 0, []
    for m in SIGNATURE.finditer(text):
        if "..." in m.group(2):
            continue
        section = re.findall(r"^## `(lifeseq_shards[\w.]*)`", text[:m.start()], re.M)[-1]
        name = m.group(1) if m.group(1).startswith("lifeseq_shards.") else f"{section}.{m.group(1)}"
        params = [p for p in inspect.signature(lookup(name)).parameters.values() if p.name != "self"]
        real = [(p.name, p.default) for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        written = []
        for arg in (a.strip() for a in m.group(2).split(", ")):
            if arg and not arg.startswith("*"):
                key, _, default = arg.partition("=")
                written.append((key, ast.literal_eval(default) if default else inspect.Parameter.empty))
        checked += 1
        if written != real:
            wrong.append(f"python-api.md:{line_of(text, m.start())}: {m.group(1)} written {written}, is {real}")
    assert checked >= 5 and not wrong, "\n".join(wrong)


# -- the reference pages' python snippets --------------------------------------------------------------------------
FENCE = re.compile(r"(?:<!-- doc-test: (.*?) -->\n)?^```python\n(.*?)^```", re.S | re.M)
# page -> (text in the page, what runs instead): the CPU for "cuda", a small model, no worker processes
EDITS: dict[str, list[tuple[str, str]]] = {
    "masking.md": [('"cuda"', '"cpu"')],
    "ddp.md": [("num_workers=4, model=model", "num_workers=0, model=model")],
}


def given(page: str, data: Path) -> dict[str, Any]:
    """What a page's snippets take as already there (the names their text assumes): a host batch read from ``data``,
    a trainer's epoch, a model and a device."""
    import torch

    from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule
    from lifeseq_shards.reader import ShardedDataset
    from lifeseq_shards.store.lengths import split_lengths
    from lifeseq_shards.store.remote import read_manifest

    if page == "masking.md":
        packed = next(iter(ShardedDataset(data, batch_size=8, packed=True)))
        lengths, _ = split_lengths(str(data), read_manifest(data), "train")
        return {"host_batch": packed, "trainer": SimpleNamespace(current_epoch=0), "e": 0, "B": 8 * 512,
                "lengths": lengths}
    vocab = read_manifest(data).vocab_size
    return {"torch": torch, "device": "cpu", "model": LifeSeqPretrainModule(EncoderConfig(16, 32, 1, 2), vocab).eval()}


def run_snippets(page: Path, names: dict[str, Any], here: Path) -> None:
    """Each python block of ``page``, top to bottom in one namespace (``names``: what the page takes as given), its
    :data:`EDITS` made; a block marked ``needs gpu`` is checked instead (its imports resolve, its keywords exist, in
    ``here``). The first block that fails raises, its traceback naming the page and line."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        directive, code = m.group(1) or "", m.group(2)
        where = f"{page.relative_to(page.parents[2])}:{line_of(text, m.start(2))}"  # docs/reference/<page>:<line>
        if "needs gpu" in directive:
            check_python(code, here, where)
            continue
        for old, new in EDITS.get(page.name, []):
            code = code.replace(old, new)
        exec(compile(code, where, "exec"), names)  # the page's own code, run as a reader would
    for old, _ in EDITS.get(page.name, []):
        assert old in text, f"{page.name}: the edit of {old!r} no longer matches the page"


@pytest.mark.slow
@pytest.mark.parametrize("page", SNIPPETS, ids=lambda p: p.name)
def test_the_reference_snippets_run(page: Path, ds8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block of the page runs (:func:`run_snippets`), in a directory where ``ds/`` is a converted
    dataset."""
    (tmp_path / "ds").symlink_to(ds8)
    monkeypatch.chdir(tmp_path)
    run_snippets(page, given(page.name, ds8), tmp_path)


def test_a_broken_snippet_fails(tmp_path: Path) -> None:
    """A block that imports a name the package lacks, or that fails when it runs, fails the check, naming its page
    and line; the blocks of a page share one namespace, so a later block uses what an earlier one made."""
    pages = tmp_path / "docs" / "reference"
    pages.mkdir(parents=True)
    page = pages / "page.md"
    page.write_text("```python\nfrom lifeseq_shards.reader.options import ReadOptions\n"
                    "opts = ReadOptions(batch_size=8)\n```\ntext\n\n```python\nassert opts.batch_size == 8\n```\n")
    run_snippets(page, {}, tmp_path)
    page.write_text("```python\nfrom lifeseq_shards.reader.options import ReadOptions\n```\n\n"
                    "```python\nReadOptions(batch_size=0)\n```\n")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1") as failed:
        run_snippets(page, {}, tmp_path)
    assert any(str(entry.path).endswith("docs/reference/page.md:6") for entry in failed.traceback)
    page.write_text("```python\nfrom lifeseq_shards.reader import NoSuchName\n```\n")
    with pytest.raises(ImportError, match="NoSuchName"):
        run_snippets(page, {}, tmp_path)


# -- results pages ---------------------------------------------------------------------------------------------------
def commit_problem(page: Path, repo: Path) -> str | None:
    """What is wrong with a results page's commit: none named (``commit abc1234`` or ``at abc1234``), or none of
    those named a commit of ``repo`` where its history is there (None: nothing)."""
    commits = COMMIT.findall(page.read_text())
    if not commits:
        return f"{page.name}: names no commit (write the one it measured: `commit <hash>`)"
    git = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True)
    if git.returncode:
        return None  # an export without history: the hashes cannot be checked here
    known = [c for c in commits if subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{c}^{{commit}}"],
                                                  capture_output=True).returncode == 0]
    return None if known else f"{page.name}: {commits} are not commits of this repository"


@pytest.mark.parametrize("page", RESULTS, ids=lambda p: str(p.relative_to(REPO / "docs" / "results")))
def test_each_results_page_names_the_commit_it_measured(page: Path) -> None:
    problem = commit_problem(page, REPO)
    assert problem is None, f"docs/results/{problem}"


def test_a_results_page_without_its_commit_is_found(tmp_path: Path) -> None:
    """A page naming no commit, or only hashes that are not commits here, is found; one naming a commit is not."""
    page = tmp_path / "numbers.md"
    page.write_text("Measured on 2026-12-03: 0.16 s.\n")
    assert "names no commit" in (commit_problem(page, REPO) or "")
    page.write_text("Measured at commit 0123abcd: 0.16 s.\n")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:  # an export without history: a hash cannot be checked, only its presence
        assert commit_problem(page, REPO) is None
        return
    assert "['0123abcd'] are not commits" in (commit_problem(page, REPO) or "")
    page.write_text(f"Measured at commit {head.stdout.strip()}: 0.16 s.\n")
    assert commit_problem(page, REPO) is None
