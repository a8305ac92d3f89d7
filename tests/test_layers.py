"""The package's boundaries (docs/architecture.md, "Who may import whom"): each part of lifeseq_shards imports only
the parts its row allows, at the top of a module or inside a function, so no import runs upwards and the parts
form no cycle. Read from the source with ``ast``: nothing is imported to check it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "lifeseq_shards"

# the size a module grows to before a coherent piece of it moves into a module of its own
MAX_LINES = 400

# each module's part: a subpackage, or a group of top-level modules that belong together
PARTS = {
    "compat": "leaves", "deprecation": "leaves", "progress": "leaves", "schedule": "leaves", "signals": "leaves",
    "store": "store", "plan": "plan", "convert": "convert",
    "device": "device", "masking": "device", "cudagraph": "device",
    "reader": "reader",
    "encoder": "model", "model": "model", "performer": "model",
    "embed": "embed",
    "datapath": "front ends", "datamodule": "front ends", "lightning_loop": "front ends", "loop": "front ends",
    "pl": "front ends", "timing": "front ends",
    "cli": "entry", "__init__": "entry",
}
# the rule, one row per part: the parts it may import (its own always); written out here, not derived from the code
MAY_IMPORT = {
    "leaves": set(),
    "store": {"leaves"},
    "plan": {"leaves"},
    "convert": {"leaves", "store"},
    "device": {"leaves", "store"},
    "reader": {"leaves", "store", "plan", "device"},
    "model": {"leaves", "store", "device"},
    "embed": {"leaves", "store", "reader"},
    "front ends": {"leaves", "store", "plan", "device", "reader", "model", "embed"},
    "entry": set(PARTS.values()),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_name(module: str) -> str:
    """``lifeseq_shards.reader.loader`` -> ``reader``; the package itself -> ``__init__``."""
    return module.split(".")[1] if "." in module else "__init__"


def part_of(module: str) -> str:
    return PARTS[top_name(module)]


def imported(path: Path, text: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, module) of every lifeseq_shards import in ``path`` (or in ``text``, as if it stood at ``path``),
    relative ones resolved, wherever it stands: at the top, under ``if``, in a function."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [".".join([*base, node.module])] if node.module else [".".join([*base, a.name])
                                                                            for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "lifeseq_shards" else [f"lifeseq_shards.{a.name}"
                                                                            for a in node.names]
        else:
            continue
        yield from ((node.lineno, n) for n in names if n == "lifeseq_shards" or n.startswith("lifeseq_shards."))


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_part() -> None:
    """A new subpackage or top-level module gets a row in the rule (and in docs/architecture.md) before it lands."""
    assert {top_name(module_name(p)) for p in modules()} <= set(PARTS)
    assert set(PARTS.values()) == set(MAY_IMPORT)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_rule(path: Path) -> None:
    mine = part_of(module_name(path))
    wrong = [f"{path.relative_to(REPO)}:{line}: {mine} imports {target} ({part_of(target)})"
             for line, target in imported(path)
             if part_of(target) != mine and part_of(target) not in MAY_IMPORT[mine]]
    assert not wrong, "\n".join(wrong)


def test_the_reader_takes_only_the_batch_types_of_the_device_side() -> None:
    taken = {target for path in sorted((PACKAGE / "reader").glob("*.py")) for _, target in imported(path)
             if part_of(target) == "device"}
    assert taken == {"lifeseq_shards.device.batch"}


def test_the_rule_has_no_cycle() -> None:
    """Ordered by the rule, every part comes after all it may import (``entry`` aside, which imports every part)."""
    order: list[str] = []
    left = {p: deps for p, deps in MAY_IMPORT.items() if p != "entry"}
    while left:
        ready = sorted(p for p, deps in left.items() if deps <= set(order))
        assert ready, f"a cycle among {sorted(left)}"
        order += ready
        for p in ready:
            del left[p]


def test_the_rule_can_fail() -> None:
    """An upward import (the store importing the reader) is found, relative or absolute, at the top or in a
    function."""
    text = "from ..reader import World\n\ndef f():\n    import lifeseq_shards.reader.loader\n"
    found = [t for _, t in imported(PACKAGE / "store" / "bad.py", text)]
    assert found == ["lifeseq_shards.reader", "lifeseq_shards.reader.loader"]
    assert all(part_of(t) not in MAY_IMPORT["store"] for t in found)


def test_the_documented_rule_is_this_one() -> None:
    """docs/architecture.md's table of who may import whom says what MAY_IMPORT says, row for row."""
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| (?:\*\*)?([a-z ]+?)(?:\*\*)? \| [^|]* \| ([^|]*) \|$", text, re.M))
    documented = {part: {p.strip(" `") for p in deps.split(",") if p.strip(" `") not in ("", "nothing", "every part")}
                  for part, deps in rows.items() if part in MAY_IMPORT}
    assert set(documented) == set(MAY_IMPORT)
    for part, deps in documented.items():
        if part != "entry":
            assert deps == MAY_IMPORT[part], part


def cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (node -> the nodes it imports), as the nodes along it, or None."""
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        return list(e.args[1])
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the lifeseq_shards modules it imports (also under ``if TYPE_CHECKING``: a circle there is one the
    types had to step around)."""
    paths = {module_name(p): p for p in modules()}
    return {m: {t for _, t in imported(p) if t != m} for m, p in paths.items()}


def test_no_module_imports_itself_in_a_circle() -> None:
    """No two modules (of one folder or of two) import each other, however many steps apart."""
    assert cycle(import_graph()) is None, " -> ".join(cycle(import_graph()) or [])


def test_the_folders_and_top_modules_form_no_circle() -> None:
    """Read as folders and top-level modules, the imports form no circle either: a folder's module does not import a
    top-level module that imports the folder back (device/build.py -> masking.py -> device/... was one)."""
    tops: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        tops.setdefault(top_name(module), set()).update(top_name(t) for t in targets if top_name(t) != top_name(module))
    assert cycle(tops) is None, " -> ".join(cycle(tops) or [])


def test_a_circle_is_found() -> None:
    """Two modules of one folder importing each other (one only for its types) are a circle; a chain is not."""
    store, stamp = PACKAGE / "embed" / "store.py", PACKAGE / "embed" / "stamp.py"
    graph = {"lifeseq_shards.embed.store": {t for _, t in imported(store, "from .stamp import Stamp\n")},
             "lifeseq_shards.embed.stamp": {t for _, t in imported(
                 stamp, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .store import EmbeddingSpec\n")}}
    assert sorted(cycle(graph) or []) == sorted(["lifeseq_shards.embed.store", "lifeseq_shards.embed.stamp",
                                                 "lifeseq_shards.embed.store"])
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_outgrows_its_size() -> None:
    """Every module is at most MAX_LINES lines."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in modules()}
    over = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"over {MAX_LINES} lines: {over}"


def unnamed_modules(init: Path) -> tuple[list[str], list[str]]:
    """The modules and subpackages of ``init``'s package, and those of them its docstring does not name as
    ``:mod:`.name```."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    here = init.parent
    names = sorted(p.stem for p in here.glob("*.py") if p.name != "__init__.py")
    names += sorted(d.name for d in here.iterdir() if (d / "__init__.py").exists())
    return names, [n for n in names if f":mod:`.{n}`" not in doc]


@pytest.mark.parametrize("init", sorted(PACKAGE.rglob("__init__.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_each_package_docstring_names_its_modules(init: Path) -> None:
    """A package's docstring says what each of its modules and subpackages does, naming it as ``:mod:`.name```."""
    names, unnamed = unnamed_modules(init)
    assert names and not unnamed, f"{init.relative_to(REPO)}: its docstring does not name {unnamed}"


def test_a_module_the_docstring_misses_is_found(tmp_path: Path) -> None:
    """A module or subpackage the docstring leaves out, or names only in passing (not as ``:mod:``), is found."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    for name in ("reads", "writes"):
        (tmp_path / f"{name}.py").write_text("")
    init = tmp_path / "__init__.py"
    init.write_text('"""Reading (:mod:`.reads`) and writing (writes.py)."""\n')
    assert unnamed_modules(init) == (["reads", "writes", "sub"], ["writes", "sub"])
    init.write_text('"""Reading (:mod:`.reads`), writing (:mod:`.writes`), the rest (:mod:`.sub`)."""\n')
    assert unnamed_modules(init)[1] == []
