"""The package's boundaries (docs/architecture.md, "Who may import whom"): each part of lifeseq_shards imports only
the parts its row allows, at the top of a module or inside a function, so no import runs upwards and the parts
form no cycle. Read from the source with ``ast``: nothing is imported to check it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO

PACKAGE = REPO / "lifeseq_shards"

# each module's part: a subpackage, or a group of top-level modules that belong together
PARTS = {
    "compat": "leaves", "progress": "leaves", "schedule": "leaves", "signals": "leaves",
    "store": "store", "plan": "plan", "convert": "convert",
    "device": "device", "masking": "device",
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
