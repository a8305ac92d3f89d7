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


@pytest.mark.slow
@pytest.mark.parametrize("page", SNIPPETS, ids=lambda p: p.name)
def test_the_reference_snippets_run(page: Path, ds8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block of the page, top to bottom in one namespace, in a directory where ``ds/`` is a converted
    dataset; a block marked ``needs gpu`` is checked instead (its imports resolve, its keywords exist)."""
    text = page.read_text()
    blocks = [(m.group(1) or "", m.group(2), line_of(text, m.start(2))) for m in FENCE.finditer(text)]
    (tmp_path / "ds").symlink_to(ds8)
    monkeypatch.chdir(tmp_path)
    names = given(page.name, ds8)
    for directive, code, line in blocks:
        where = f"{page.relative_to(REPO)}:{line}"
        if "needs gpu" in directive:
            check_python(code, tmp_path, where)
            continue
        for old, new in EDITS.get(page.name, []):
            if old in code:
                code = code.replace(old, new)
        exec(compile(code, where, "exec"), names)  # the page's own code, run as a reader would
    for old, _ in EDITS.get(page.name, []):
        assert old in text, f"{page.name}: the edit of {old!r} no longer matches the page"


# -- results pages ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", RESULTS, ids=lambda p: str(p.relative_to(REPO / "docs" / "results")))
def test_each_results_page_names_the_commit_it_measured(page: Path) -> None:
    """``commit abc1234`` or ``at abc1234`` on the page, a commit of this repository where its history is here."""
    commits = COMMIT.findall(page.read_text())
    assert commits, f"{page.relative_to(REPO)}: names no commit (write the one it measured: `commit <hash>`)"
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True)
    if git.returncode == 0:
        known = [c for c in commits if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{c}^{{commit}}"],
                                                      capture_output=True).returncode == 0]
        assert known, f"{page.relative_to(REPO)}: {commits} are not commits of this repository"
