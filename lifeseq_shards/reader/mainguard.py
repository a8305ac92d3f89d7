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


def refuse_a_main_script_from_stdin() -> None:
    """`python -` has no script to run again: its workers died with "No such file or directory: '.../<stdin>'"
    under torch's "DataLoader worker exited unexpectedly". Say so in one line instead."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file == "<stdin>":
        raise ValueError('ShardedLoader: workers start from a forkserver, which re-runs the main script, and a script '
                         'read from stdin (python -) cannot be re-run: save it to a file, or pass '
                         'multiprocessing_context="fork" (or num_workers=0)')


def refuse_an_unguarded_main(start_method: str | None) -> None:
    """RuntimeError naming the line if workers of ``start_method`` are about to start from the main script's top
    level outside its ``if __name__ == "__main__":`` block (where the workers, running the script again, would
    reach it too). Nothing when the method forks, there is no script file (a notebook, ``python -c``), or its
    source cannot be read."""
    if start_method not in ("forkserver", "spawn"):
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


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of the top-level ``if __name__ == "__main__":`` blocks of the script at ``path`` (None if it
    cannot be read or parsed: then nothing is refused)."""
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    return tuple((node.lineno, node.end_lineno or node.lineno) for node in tree.body
                 if isinstance(node, ast.If) and _is_main_test(node.test))


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(a, ast.Name) and a.id == "__name__" for a in sides) and \
        any(isinstance(a, ast.Constant) and a.value == "__main__" for a in sides)
