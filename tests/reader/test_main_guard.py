"""A script that runs the loader's workers from its top level, without `if __name__ == "__main__":` (issue 33): the
workers start from a forkserver, which runs the script again in each. Before, that ended in Python's
"bootstrapping phase" error and torch's "DataLoader worker ... exited unexpectedly"; now the training process
refuses before any worker starts, and the last line says what to do. Real scripts in real subprocesses."""

from __future__ import annotations

import ast
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import repo_first, scaled

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World, mainguard

RUN_S = 180  # one script, at most (a hang fails)
READ = "ds = ShardedDataset({root!r}, split='train', batch_size=32, num_workers=2, world=World(0, 1))\n"
LOOP = "print(sum(1 for _ in ShardedLoader(ds)), 'batches')\n"
IMPORTS = "from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw, out = tmp_path_factory.mktemp("raw"), tmp_path_factory.mktemp("ds")
    synth_population(raw, 300, seed=5, progress=False)
    convert_dataset([str(raw / "sequences.parquet")], out, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=2, num_val=20))
    return out


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(IMPORTS + body)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=scaled(RUN_S),
                          cwd=tmp_path, env=repo_first(dict(os.environ)), start_new_session=True)


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("how", ["top level", "a function called from the top level"])
def test_an_unguarded_script_is_told_to_add_the_main_guard(root: Path, tmp_path: Path, how: str) -> None:
    body = READ.format(root=str(root)) + (LOOP if how == "top level" else "def main():\n    " + LOOP + "main()\n")
    r = run_script(tmp_path, body)
    assert r.returncode != 0
    last = last_line(r.stderr)
    assert 'if __name__ == "__main__":' in last and f"{tmp_path / 'train.py'}, line" in last, r.stderr[-3000:]
    assert r.stderr.count("Traceback") == 1 and "DataLoader worker (pid" not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["in the block", "loader built at the top level, read in the block"])
def test_a_guarded_script_reads_its_batches(root: Path, tmp_path: Path, how: str) -> None:
    if how == "in the block":
        body = 'if __name__ == "__main__":\n    ' + READ.format(root=str(root)) + "    " + LOOP
    else:
        body = READ.format(root=str(root)) + 'if __name__ == "__main__":\n    ' + LOOP
    r = run_script(tmp_path, body)
    assert r.returncode == 0 and r.stdout.strip().endswith("batches"), r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("guard", [
    'if __name__ == "__main__" and len(sys.argv) == 1:\n',
    'if __name__ != "__main__":\n    pass\nelse:\n',
    'if "__main__" != __name__ or len(sys.argv) > 1:\n    pass\nelse:\n',
    'if len(sys.argv) > 1:\n    pass\nelif not __name__ != "__main__":\n',
], ids=["and", "else of !=", "else of != or", "elif not !="])
def test_every_guard_the_main_script_alone_reaches_reads_its_batches(root: Path, tmp_path: Path, guard: str) -> None:
    """Issue 40: the guard was the text of one `if`; `if __name__ == "__main__" and ...:` and the `else:` of
    `if __name__ != "__main__":` were refused though a worker never reaches them."""
    body = "import sys\n" + guard + "    " + READ.format(root=str(root)) + "    " + LOOP
    r = run_script(tmp_path, body)
    assert r.returncode == 0 and r.stdout.strip().endswith("batches"), r.stderr[-3000:]


@pytest.mark.slow
def test_a_guard_a_worker_also_passes_is_still_refused(root: Path, tmp_path: Path) -> None:
    """`or` lets a worker (`__mp_main__`) in: refused as before."""
    body = "import sys\n" + 'if __name__ == "__main__" or len(sys.argv) == 1:\n    ' + READ.format(root=str(root)) \
        + "    " + LOOP
    r = run_script(tmp_path, body)
    assert r.returncode != 0 and 'if __name__ == "__main__":' in last_line(r.stderr), r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_script_from_stdin_is_refused_whatever_context_it_names(root: Path, context: str) -> None:
    """Issue 40: `python -` was refused only when the caller named no context; naming spawn ended in 79 lines and
    "DataLoader worker exited unexpectedly"."""
    named = f"ShardedLoader(ds, multiprocessing_context={context!r})"
    script = IMPORTS + READ.format(root=str(root)) + LOOP.replace("ShardedLoader(ds)", named)
    r = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=scaled(RUN_S),
                       env=repo_first(dict(os.environ)), start_new_session=True)
    assert r.returncode != 0
    last = last_line(r.stderr)
    assert last.startswith("ValueError:") and f"start by {context}" in last and "stdin" in last, r.stderr[-3000:]
    assert "exited unexpectedly" not in r.stderr


# -- what the workers' forkserver imports for them ------------------------------------------------------------------
HEAVY = "import os\nwith open(os.path.join(os.path.dirname(__file__), 'imported.txt'), 'a') as f:\n" \
        "    print(os.getpid(), file=f)\n"


def test_a_workers_rerun_of_the_script_imports_nothing_the_forkserver_imported(root: Path, tmp_path: Path) -> None:
    """The script's top-level imports (here a module that notes each process importing it, standing in for
    Lightning's seconds) are imported by the training process and once by the workers' forkserver: not again by
    each of the 4 workers of 2 passes, which run the script again. Before, each worker imported them itself (4-10
    s of CPU a worker for a script importing Lightning)."""
    (tmp_path / "heavy.py").write_text(HEAVY)
    body = ("import os\nimport heavy\n"
            'if __name__ == "__main__":\n    ' + READ.format(root=str(root))
            + "    for _ in range(2):\n        " + LOOP + "    print('main', os.getpid())\n")
    r = run_script(tmp_path, body)
    assert r.returncode == 0 and r.stdout.count("batches") == 2, r.stderr[-3000:]
    main = int(r.stdout.split("main ")[1])
    importers = [int(line) for line in (tmp_path / "imported.txt").read_text().split()]
    assert len(importers) == 2 and importers[0] == main and importers[1] != main, importers


def test_the_imports_a_worker_reaches_are_those_outside_functions_and_the_main_block() -> None:
    source = ("import os, json as j\n"
              "from collections import abc, OrderedDict\n"
              "from . import sibling\n"
              "try:\n    import tomllib\nexcept ImportError:\n    import csv\n"
              "if os.name == 'nt':\n    import ntpath\nelse:\n    import posixpath\n"
              "def f():\n    import shutil\n"
              "class C:\n    import glob\n"
              'if __name__ == "__main__":\n    import argparse\nelse:\n    import textwrap\n')
    found = mainguard._imports(ast.parse(source).body)
    assert found == ["os", "json", "collections", "collections.abc", "collections.OrderedDict", "tomllib", "csv",
                     "ntpath", "posixpath", "textwrap"]


def test_a_context_the_caller_passes_keeps_its_forkservers_preload(root: Path) -> None:
    """The loader built its own context, setting the (process-wide) forkserver's preload list, even when the caller
    passed one."""
    server = multiprocessing.forkserver._forkserver
    before = server._preload_modules
    ctx = multiprocessing.get_context("forkserver")
    try:
        ctx.set_forkserver_preload(["json"])
        ds = ShardedDataset(root, split="train", batch_size=32, num_workers=2, world=World(0, 1))
        ShardedLoader(ds, multiprocessing_context=ctx)
        assert server._preload_modules == ["json"]
    finally:
        server._preload_modules = before
