"""`make test`'s pytest-xdist processes (tests/xdist_groups.py), on a small suite of their own laid out as the
suite's files are: in 2 real xdist processes, a session fixture named like a shared launch is launched once though
tests in two files read it, and each file's tests run in one process; a file not listed that reads it is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from helpers import REPO, repo_first, scaled

CONFTEST = """
import os
from pathlib import Path

import pytest


def note(name, line):
    with open(Path(__file__).parent / name, "a") as f:
        f.write(line + "\\n")


@pytest.fixture(scope="session")
def torchrun_two():  # named as the suite's 2x2 torchrun run; here it notes who launched it
    note("launches.txt", os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(autouse=True)
def where(request):
    note("ran.txt", f"{request.node.path.name} {os.environ['PYTEST_XDIST_WORKER']}")
"""
READS = """
import time

import pytest


@pytest.mark.parametrize("i", range(6))
def test_reads(torchrun_two, i):
    time.sleep(0.1)


@pytest.mark.parametrize("i", range(3))
def test_not(i):
    time.sleep(0.1)
"""
ALONE = """
import time

import pytest


@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    time.sleep(0.1)
"""


def suite(root: Path, files: dict[str, str]) -> None:
    """A suite under ``root``: the conftest above, then each file (its path from ``root``: its text)."""
    (root / "conftest.py").write_text(CONFTEST)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest, with the plugin, on the suite under ``root`` (its own root directory, no configuration)."""
    env = repo_first(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist_groups", "-p", "no:cacheprovider",
                           *args, "-c", os.devnull, "--rootdir", str(root), str(root)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=scaled(120))


def test_a_shared_launch_runs_once_and_a_file_in_one_process(tmp_path: Path) -> None:
    """Two of the suite's files that read a shared launch, two that do not; with xdist's plain ``loadfile`` the two
    readers go to both processes, and each launches it (checked: 2 launches without the plugin)."""
    suite(tmp_path, {"tests/reader/test_ddp.py": READS, "tests/test_compat.py": READS,
                     "tests/test_c.py": ALONE, "tests/test_d.py": ALONE})
    run = pytest_in(tmp_path, "-n", "2", "--dist", "loadfile")
    assert "30 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert len((tmp_path / "launches.txt").read_text().split()) == 1
    workers = defaultdict(set)
    for line in (tmp_path / "ran.txt").read_text().splitlines():
        name, worker = line.split()
        workers[name].add(worker)
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert workers["test_ddp.py"] == workers["test_compat.py"]
    assert len(set().union(*workers.values())) == 2, dict(workers)  # both processes took a share


def test_a_file_not_listed_that_reads_a_shared_launch_is_refused(tmp_path: Path) -> None:
    suite(tmp_path, {"tests/test_new.py": READS})
    run = pytest_in(tmp_path)
    assert run.returncode != 0
    assert ("tests/test_new.py reads torchrun_two: add it to tests/xdist_groups.py's SHARED_FILES"
            in run.stdout + run.stderr), run.stdout[-3000:] + run.stderr[-2000:]
