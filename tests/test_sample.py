"""The researchers' sample the repository carries (tests/data/lifeseq-sample) is theirs byte for byte, checked
wherever their files are at hand (../shared beside the clone, as CI and the development machines have it), and the
suite reads the carried copy where they are not, so that a fresh clone passes its tests with nothing beside it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sample_files import CARRIED_SAMPLE, REPO, SAMPLE_FILES, SHARED_SAMPLE


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(not (SHARED_SAMPLE / "encoded_mlm.h5").exists(), reason=f"{SHARED_SAMPLE} is not at hand")
@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_carried_sample_is_theirs_byte_for_byte(name: str) -> None:
    assert _sha256(CARRIED_SAMPLE / name) == _sha256(SHARED_SAMPLE / name), f"{CARRIED_SAMPLE / name}"


def test_without_shared_the_suite_reads_the_carried_sample(tmp_path: Path) -> None:
    """A fresh machine: LIFESEQ_SHARED names a folder with no sample in it, and the fixture gives the carried copy."""
    code = "import sample_files; print(sample_files.SAMPLE)"
    env = {**os.environ, "LIFESEQ_SHARED": str(tmp_path / "no-shared"), "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO)
    assert Path(out.stdout.strip()) == CARRIED_SAMPLE
    assert all((CARRIED_SAMPLE / name).is_file() for name in SAMPLE_FILES)
