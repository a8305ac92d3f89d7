"""The checks tests/test_docs.py makes of a guide's block that cannot run here (a GPU, a SLURM cluster, the
researchers' repository): every program, subcommand and flag exists, every import resolves, every keyword passed to
an imported callable is one it takes."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import REPO, repo_first, scaled

BLOCK_S = 300  # one block: a Lightning fit on a 2-core machine shared with other jobs


def env() -> dict[str, str]:
    """This interpreter's environment first on PATH (its `shardify`, `torchrun`), this checkout first on PYTHONPATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return repo_first({**os.environ, "PATH": path, "OMP_NUM_THREADS": "1"})


def run(cmd: list[str], cwd: Path, timeout: float = BLOCK_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=scaled(timeout))


# -- static checks: what a block that cannot run here must still get right -------------------------------------
def commands(code: str) -> list[list[str]]:
    """The shell commands of a bash block (continuations joined, comments dropped, ``a && b`` two commands), each
    split into words."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in re.split(r"\s&&\s", line):
            words = shlex.split(part, comments=True)
            inner = re.fullmatch(r"[A-Za-z_]+=\$\((\S+)", words[0]) if words else None
            if inner and words[-1].endswith(")"):  # VAR=$(command ...): the command
                words = [inner.group(1), *words[1:-1], words[-1][:-1]]
            while words and re.fullmatch(r"[A-Za-z_]+=.*", words[0]):  # VAR=value before a command
                words = words[1:]
            if words:
                out.append(words)
    return out


SHELL = {"trap", "exit", "["}  # the bash builtins a job script of the guides uses


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w != "-"]


@functools.cache
def help_text(*cmd: str) -> str:
    r = run([*cmd, "--help"], REPO, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)} --help: {r.stderr[-2000:]}"
    return r.stdout


def check_shardify(args: list[str]) -> None:
    """The subcommand exists and takes every option given, and every required one is given."""
    import click

    from lifeseq_shards.cli import main

    command: click.Command = main
    rest = list(args)
    while isinstance(command, click.Group):
        assert rest and rest[0] in command.commands, f"shardify: no command {rest[:1]} in {sorted(command.commands)}"
        command = command.commands[rest.pop(0)]
    known = {o for p in command.params for o in [*p.opts, *p.secondary_opts]} | {"--help"}
    unknown = [f for f in flags(rest) if f not in known]
    assert not unknown, f"shardify {command.name}: no option {unknown} (has {sorted(known)})"
    for p in command.params:
        if isinstance(p, click.Option) and p.required:
            assert set(p.opts) & set(flags(rest)), f"shardify {command.name}: {p.opts[0]} is required"


def check_diff(path: Path) -> None:
    """A diff git can read, whose added `lifeseq_shards` imports all resolve."""
    r = run(["git", "apply", "--stat", str(path)], REPO)
    assert r.returncode == 0 and "changed" in r.stdout, f"git apply --stat {path}: {r.stderr}"
    added = "\n".join(line[1:].strip() for line in path.read_text().splitlines() if line.startswith("+")
                      and not line.startswith("+++"))
    imports = re.findall(r"^(from lifeseq_shards\S* import [\w, ]+)", added, re.M)
    assert imports, f"{path}: no lifeseq_shards import added"
    check_python("\n".join(imports), Path("."))


def diff_base(path: Path) -> tuple[str, str, str]:
    """What a diff's header says it was made against: (the file's path in their repository, its sha256, the
    abbreviated git blob of its ``index`` line)."""
    text = path.read_text()
    target = re.search(r"^diff --git a/(\S+) b/", text, re.M)
    sha = re.search(r"^base-sha256: ([0-9a-f]{64})$", text, re.M)
    index = re.search(r"^index ([0-9a-f]{7,40})\.\.", text, re.M)
    assert target and sha and index, f"{path}: needs a 'base-sha256: <hex>' line before its one file's diff"
    return target.group(1), sha.group(1), index.group(1)


def check_diff_base(path: Path, base: Path, tree: Path) -> Path:
    """``base`` is the file the diff ``path`` names by sha256 and git blob, and the diff applies to it: a copy of it
    at its path under ``tree`` is patched (``git apply --check``, then applied); returns the patched file."""
    target, sha, blob = diff_base(path)
    got = hashlib.sha256(base.read_bytes()).hexdigest()
    assert got == sha, f"{base}: sha256 {got}, but {path.name} was made against {sha}"
    hashed = run(["git", "hash-object", str(base)], REPO).stdout.strip()
    assert hashed.startswith(blob), f"{base}: git blob {hashed}, but {path.name}'s index line says {blob}"
    copy = tree / target
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(base, copy)
    for check in (["--check"], []):
        r = run(["git", "apply", *check, str(path)], tree)
        assert r.returncode == 0, f"git apply {' '.join(check)} {path.name} to {base}: {r.stderr.strip()}"
    return copy


def check_command(words: list[str], cwd: Path, where: str) -> None:
    program, args = words[0], words[1:]
    if program == "shardify":
        check_shardify(args)
    elif program == "srun":  # its options, then the command it starts
        while args and args[0].startswith("-"):
            args = args[1:]
        check_command(args, cwd, where)
    elif program == "sbatch":
        script = cwd / [a for a in args if not a.startswith("-")][0]
        assert script.exists(), f"{where}: sbatch {script.name}: no such file written by the guide"
        for command in commands(script.read_text()):
            check_command(command, cwd, where)
    elif program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        check_command(["python", parsed.training_script, *parsed.training_script_args], cwd, where)
    elif program == "python" and args[:1] == ["-m"]:
        known = help_text(sys.executable, "-m", args[1])
        unknown = [f for f in flags(args[2:]) if f not in known]
        assert not unknown, f"{where}: python -m {args[1]}: no option {unknown}"
    elif program == "python" and args[:1] == ["-c"]:
        check_python(args[1], cwd)
    elif program == "python":
        script = cwd / args[0]
        assert script.exists(), f"{where}: python {args[0]}: no such file written by the guide"
        check_python(script.read_text(), cwd)
    elif program == "git" and args[:1] == ["apply"]:
        check_diff(REPO / args[-1].replace("/path/to/lifeseq-shards/", ""))
    elif program == "make":
        targets = re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M)
        assert all(t in targets for t in args), f"{where}: make {args}: no such target (has {targets})"
    elif program in SHELL:
        pass
    elif program == "scontrol":
        assert args[:1] == ["requeue"], f"{where}: scontrol {args[:1]}: not taught here (requeue is)"
    elif program == "pip":
        unknown = [f for f in flags(args[1:]) if f not in help_text(sys.executable, "-m", "pip", args[0])]
        assert not unknown, f"{where}: pip {args[0]}: no option {unknown}"
    else:
        raise AssertionError(f"{where}: no check for {program!r}: teach tests/test_docs.py one")


def resolve(node: ast.expr, names: dict[str, Any]) -> Any:
    """What a name or a dotted attribute of an imported name is, or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = resolve(node.value, names)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def parameters(obj: Any) -> tuple[set[str], bool]:
    """The keyword names ``obj`` takes (a class: its ``__init__`` and, behind ``**kwargs``, its bases'), and whether
    it takes any keyword at all (``**kwargs`` to the end)."""
    chain = [c.__init__ for c in inspect.getmro(obj) if "__init__" in vars(c)] if inspect.isclass(obj) else [obj]
    names: set[str] = set()
    for fn in chain:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return names, True
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names, False
    return names, True


def check_python(code: str, cwd: Path, where: str = "") -> None:
    """Compiles; every import resolves; every keyword passed to an imported callable is one it takes."""
    tree = ast.parse(code)
    names: dict[str, Any] = {}
    sys.path.insert(0, str(cwd))
    try:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = importlib.import_module(alias.name)
                    names[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else importlib.import_module(alias.name.split(".")[0]))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    names[alias.asname or alias.name] = value
    finally:
        sys.path.remove(str(cwd))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.keywords:
            target = resolve(node.func, names)
            if target is None or not callable(target):
                continue
            takes, any_keyword = parameters(target)
            unknown = [k.arg for k in node.keywords if k.arg and k.arg not in takes]
            assert any_keyword or not unknown, (
                f"{where}: {ast.unparse(node.func)}() takes no keyword {unknown} (takes {sorted(takes)})")
