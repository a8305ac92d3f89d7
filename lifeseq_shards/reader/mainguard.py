"""Workers that start from a forkserver (the loader's default) or by spawn run the main script again, as its module
``__mp_main__``: a script that starts the loader's workers from its top level, outside ``if __name__ ==
"__main__":``, would have every worker start workers of its own. Python then stops each worker with its
"bootstrapping phase" error and torch reports only "DataLoader worker ... exited unexpectedly". These checks say
what to do instead, in the training process, before any worker starts."""

from __future__ import annotations

import ast
import functools
import sys
from types import FrameType

FIX = ('put the code that runs the loader under `if __name__ == "__main__":` (in a function it calls, or in the '
       'block itself), or pass multiprocessing_context="fork" (or num_workers=0) to ShardedLoader')


RERUN = ("forkserver", "spawn")  # the start methods whose workers run the main script again


def refuse_a_main_script_from_stdin(start_method: str | None) -> None:
    """`python -` has no script to run again: workers of ``start_method`` (the loader's, whether the caller named it
    or not) died with "No such file or directory: '.../<stdin>'" under torch's "DataLoader worker exited
    unexpectedly". Say so in one line instead."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if start_method in RERUN and main_file == "<stdin>":
        raise ValueError(f"ShardedLoader: workers start by {start_method}, which re-runs the main script, and a "
                         "script read from stdin (python -) cannot be re-run: save it to a file, or pass "
                         'multiprocessing_context="fork" (or num_workers=0)')


def refuse_an_unguarded_main(start_method: str | None) -> None:
    """RuntimeError naming the line if workers of ``start_method`` are about to start from the main script's top
    level outside its ``if __name__ == "__main__":`` block (where the workers, running the script again, would
    reach it too). Nothing when the method forks, there is no script file (a notebook, ``python -c``), or its
    source cannot be read."""
    if start_method not in RERUN:
        return
    frame = _main_module_frame()
    path = frame and frame.f_code.co_filename
    if not frame or not path or path.startswith("<"):
        return
    guarded = _guarded_lines(path)
    if guarded is None or any(first <= frame.f_lineno <= last for first, last in guarded):
        return
    raise RuntimeError(f"ShardedLoader: {path}, line {frame.f_lineno}, starts the loader's workers outside "
                       f'`if __name__ == "__main__":`; they start by {start_method}, which runs the script again in '
                       f"each worker, where this line would start workers of its own (Python's 'bootstrapping "
                       f"phase' error, then 'DataLoader worker exited unexpectedly'): {FIX}")


def _main_module_frame() -> FrameType | None:
    """The frame running the main script's top-level code, if this call comes from it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None


def main_imports() -> list[str]:
    """The modules the main script imports where its workers run it again (outside its ``__main__`` block and its
    functions) that this process holds: the forkserver imports them once, before it starts any worker, so that a
    worker running the script finds them imported. Without them each worker imports them itself: 4-10 s of CPU
    for a script that imports Lightning, as the researchers' pretrain.py and the plain-loop guide's do
    (docs/results/worker-start.md). Empty where there is no script file."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or path.startswith("<"):
        return []
    tree = _parsed(path)
    return [] if tree is None else [m for m in dict.fromkeys(_imports(tree.body)) if m in sys.modules]


def _imports(body: list[ast.stmt]) -> list[str]:
    """The absolute imports of ``body`` outside functions, classes and the branches only ``__main__`` takes: each
    module named, and each name imported from a module that is itself a module (``from a import b``: ``a.b``)."""
    found: list[str] = []
    for node in body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.If):
            for branch, holds in ((node.body, True), (node.orelse, False)):
                if not _implies_main(node.test, holds):
                    found += _imports(branch)
        elif isinstance(node, ast.Try):
            for branch in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += _imports(branch)
    return found


@functools.lru_cache(maxsize=8)
def _parsed(path: str) -> ast.Module | None:
    """The script at ``path`` parsed (None if it cannot be read or parsed)."""
    try:
        with open(path, "rb") as fh:
            return ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def _guarded_lines(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the script at ``path`` that run only when ``__name__ == "__main__"`` (None if it cannot
    be read or parsed: then nothing is refused)."""
    tree = _parsed(path)
    return None if tree is None else tuple(_main_only(tree.body))


def _main_only(body: list[ast.stmt]) -> list[tuple[int, int]]:
    """The branches of the ``if`` statements in ``body`` (and in the branches of those) that only the main script
    reaches: an ``if`` whose test holds only in ``__main__`` (``__name__ == "__main__"``, also ``and`` more), and the
    ``else`` of one whose test fails only there (``__name__ != "__main__"``, also ``or`` more)."""
    found: list[tuple[int, int]] = []
    for node in body:
        if not isinstance(node, ast.If):
            continue
        for branch, holds in ((node.body, True), (node.orelse, False)):
            main = _implies_main(node.test, holds)
            if main and branch:
                found.append((branch[0].lineno, branch[-1].end_lineno or branch[-1].lineno))
            elif branch:
                found += _main_only(branch)
    return found


def _implies_main(test: ast.expr, holds: bool) -> bool:
    """Whether ``test`` evaluating to ``holds`` implies ``__name__ == "__main__"``: for ``holds`` an ``and`` needs one
    such part and an ``or`` all of them; for not ``holds`` the other way round (De Morgan)."""
    if isinstance(test, ast.BoolOp):
        parts = [_implies_main(v, holds) for v in test.values]
        return any(parts) if isinstance(test.op, ast.And) == holds else all(parts)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _implies_main(test.operand, not holds)
    return _compares_name(test, ast.Eq if holds else ast.NotEq)


def _compares_name(test: ast.expr, op: type[ast.cmpop]) -> bool:
    """``__name__ <op> "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(a, ast.Name) and a.id == "__name__" for a in sides) and \
        any(isinstance(a, ast.Constant) and a.value == "__main__" for a in sides)
