"""A script that runs the loader's workers from its top level, without `if __name__ == "__main__":` (issue 33): the
workers start from a forkserver, which runs the script again in each. Before, that ended in Python's
"bootstrapping phase" error and torch's "DataLoader worker ... exited unexpectedly"; now the training process
refuses before any worker starts, and the last line says what to do. Real scripts in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import repo_first, scaled

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population

RUN_S = 180  # one script, at most (a hang fails)
READ = "ds = ShardedDataset({root!r}, 'train', batch_size=32, num_workers=2, world=World(0, 1))\n"
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


@pytest.mark.parametrize("how", ["in the block", "loader built at the top level, read in the block"])
def test_a_guarded_script_reads_its_batches(root: Path, tmp_path: Path, how: str) -> None:
    if how == "in the block":
        body = 'if __name__ == "__main__":\n    ' + READ.format(root=str(root)) + "    " + LOOP
    else:
        body = READ.format(root=str(root)) + 'if __name__ == "__main__":\n    ' + LOOP
    r = run_script(tmp_path, body)
    assert r.returncode == 0 and r.stdout.strip().endswith("batches"), r.stderr[-3000:]
