"""One variable, LIFESEQ_TEST_TIME_SCALE, stretches every deadline of the tests (helpers.scaled): pytest-timeout's
limits, through conftest.py's hook, and the multi-process launches' deadlines, each seen to fail without it and to
pass with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_harness import launch
from helpers import REPO, TIME_SCALE, repo_first, scaled

SLEEPS = """
import time

import pytest


@pytest.mark.timeout(1)
def test_marked():
    time.sleep(2)


def test_default():  # the run's --timeout 1
    time.sleep(2)
"""


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "inf", "nan"])
def test_a_bad_scale_is_refused_naming_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIME_SCALE, raw)
    with pytest.raises(ValueError, match=f"^{TIME_SCALE}='{raw}': give a positive number"):
        scaled(1)


def test_scaled_multiplies_by_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIME_SCALE, raising=False)
    assert scaled(60) == 60
    monkeypatch.setenv(TIME_SCALE, "2.5")
    assert scaled(60) == 150


@pytest.mark.slow
@pytest.mark.parametrize(("scale", "outcome"), [("1", "2 failed"), ("5", "2 passed")])
def test_pytest_timeout_scales(scale: str, outcome: str, tmp_path: Path) -> None:
    """Tests that sleep 2 s under a 1 s limit (a marker's, and the run's default) time out at scale 1 and pass at
    scale 5: the hook in conftest.py (loaded here as a plugin) scales both kinds of limit."""
    (tmp_path / "test_sleeps.py").write_text(SLEEPS)
    env = repo_first({**os.environ, TIME_SCALE: scale})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--timeout", "1", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert outcome in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    assert ("Timeout" in run.stdout) == (outcome == "2 failed"), run.stdout[-3000:]


def test_a_launch_deadline_scales(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process of 2 s under a launch deadline of 1 s is killed at scale 1 and finishes at scale 5."""
    sleep = [[sys.executable, "-c", "import time; time.sleep(2)"]]
    monkeypatch.setenv(TIME_SCALE, "1")
    with pytest.raises(pytest.fail.Exception, match="hung: killed after 1.0 s"):
        launch(sleep, tmp_path / "short", 1)
    monkeypatch.setenv(TIME_SCALE, "5")
    launch(sleep, tmp_path / "long", 1)
