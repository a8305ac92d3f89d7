"""Shared fixtures: the researchers' sample files (../shared where at hand, else the copy the repository carries) and
small converted datasets."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_harness import SPAWN_CKPT, SPAWN_RUN, SPAWN_S, fit_with_checkpoints, resume
from helpers import SMALL_SHARDS, SeedRows, copy_of, scaled
from hypothesis import settings
from pytest_timeout import get_env_settings
from sample_files import SAMPLE

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset

# Hypothesis's per-example deadline (200 ms) measures the machine, not the code: on a loaded 2-core CI runner an
# unchanged plan function missed it. The properties and example counts stay as written.
settings.register_profile("lifeseq", deadline=None)
settings.load_profile("lifeseq")

# One OpenMP thread per test process, and in the processes the tests start (they inherit it). `make test` runs two
# stacks side by side on 2 cores and many tests start ranks of their own: torch's second OpenMP thread then spins at
# every barrier for a core that is taken. Measured under `make test`'s load: tests/test_performer.py and
# test_model.py took 41 s (21 s of CPU) with torch's default of 2 threads, 23 s (12 s) with one. A value set outside
# the suite is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config: pytest.Config) -> None:
    """The suite's pytest-xdist groups: tests/xdist_groups.py."""
    config.pluginmanager.import_plugin("xdist_groups")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``cuda`` is skipped where there is no CUDA device (pyproject's marker says so)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limit of each test (its ``timeout`` marker's, else pyproject's ``timeout``) times
    LIFESEQ_TEST_TIME_SCALE (helpers.scaled): a marker with the scaled limit goes first on the test, where
    pytest-timeout looks."""
    default = get_env_settings(config).timeout
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is None:
            limit, rest, extra = default, (), {}
        else:
            limit = marker.args[0] if marker.args else marker.kwargs.get("timeout")
            rest, extra = marker.args[1:], {k: v for k, v in marker.kwargs.items() if k != "timeout"}
        if limit:  # None or 0: no limit, which scales to none
            item.add_marker(pytest.mark.timeout(scaled(float(limit)), *rest, **extra), append=False)


@pytest.fixture(scope="session")
def start_method() -> str:
    return multiprocessing.get_start_method()


@pytest.fixture(autouse=True)
def start_method_kept(start_method: str) -> Iterator[None]:
    """A test that leaves the process-wide multiprocessing start method changed, or whose fixtures do, fails (and
    the method is put back): `make test`'s processes run many test files each, and a later file's DataLoader
    workers would start another way (litdata.optimize left spawn behind, and a persistent-worker test two files
    later failed to pickle its dataset)."""
    yield
    now = multiprocessing.get_start_method()
    if now != start_method:
        multiprocessing.set_start_method(start_method, force=True)
        pytest.fail(f"this test or its fixtures left the multiprocessing start method {now!r} (it was "
                    f"{start_method!r})")


@pytest.fixture(scope="session")
def sample() -> Path:
    if not (SAMPLE / "encoded_mlm.h5").exists():
        pytest.fail(f"{SAMPLE}: the sample is missing (the repository carries it in tests/data/lifeseq-sample)")
    return SAMPLE


@pytest.fixture(scope="session")
def nomlm_rows(sample: Path) -> SeedRows:
    """The seed's rows of encoded_nomlm.h5, the reference the converted persons are compared with."""
    return SeedRows.from_h5(sample / "encoded_nomlm.h5")


@pytest.fixture(scope="session")
def mlm_rows(sample: Path) -> SeedRows:
    return SeedRows.from_h5(sample / "encoded_mlm.h5")


# -- the sample converted: each conversion once per session, read-only (a test that edits one edits a copy) ---------
def _nomlm(sample: Path, out: Path, **opts: Any) -> Path:
    """encoded_nomlm.h5 converted in SMALL_SHARDS (``opts``: more ConvertOptions)."""
    convert_dataset([str(sample / "encoded_nomlm.h5")], out,
                    opts=ConvertOptions(progress=False, **SMALL_SHARDS, **opts))
    return out


@pytest.fixture(scope="session")
def mlm_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_mlm.h5 converted: 48 train shards of 115 persons + a 45-person remainder, 2 val shards (small shards,
    ``SMALL_SHARDS``, so that the partition tests have many shards to deal between ranks and workers)."""
    out = tmp_path_factory.mktemp("mlm")
    convert_dataset([str(sample / "encoded_mlm.h5")], out, opts=ConvertOptions(progress=False, **SMALL_SHARDS))
    return out


@pytest.fixture(scope="session")
def nomlm_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_nomlm.h5 in SMALL_SHARDS (115-person shards, one block each), with the `all` split."""
    return _nomlm(sample, tmp_path_factory.mktemp("nomlm"), with_all=True)


@pytest.fixture(scope="session")
def reseeded(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_nomlm.h5 converted again with another seed: same shard names and sizes, other persons in them."""
    return _nomlm(sample, tmp_path_factory.mktemp("reseeded"), seed=1)


@pytest.fixture(scope="session")
def blocks16(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """encoded_nomlm.h5 in 16-person blocks: each 115-person shard has 8 blocks (7 of 16 persons, one of 3)."""
    return _nomlm(sample, tmp_path_factory.mktemp("blocks16"), block_persons=16)


@pytest.fixture(scope="session")
def reseeded16(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``blocks16`` converted with another seed: same shard names, sizes and schema, other persons in them (other
    content, other fingerprint)."""
    return _nomlm(sample, tmp_path_factory.mktemp("reseeded16"), block_persons=16, seed=1)


def _with_vocab(sample: Path, out: Path, shards: int) -> Path:
    """encoded_nomlm.h5 in ``shards`` train shards, converted with --vocab: the manifest knows the vocabulary size
    (which dynamic masking takes)."""
    convert_dataset([str(sample / "encoded_nomlm.h5")], out, str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=shards))
    return out


@pytest.fixture(scope="session")
def vocab_dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _with_vocab(sample, tmp_path_factory.mktemp("vocab"), 4)


@pytest.fixture(scope="session")
def ds8(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 train shards of 695 + a 5-person remainder, 8 val shards of 35: divides 2 ranks x 2 workers and 4 x 2."""
    return _with_vocab(sample, tmp_path_factory.mktemp("ds8"), 8)


@pytest.fixture(scope="session")
def ds7(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 train shards, 7 val shards: does not divide 2 ranks x 2 workers."""
    return _with_vocab(sample, tmp_path_factory.mktemp("ds7"), 7)


@pytest.fixture
def nomlm_copy(nomlm_dataset: Path, tmp_path: Path) -> Path:
    """A copy of ``nomlm_dataset`` that the test may edit."""
    return copy_of(nomlm_dataset, tmp_path)


# The Lightning ddp_spawn fit and its resume from a mid-epoch checkpoint, launched once a session: tests/reader/
# test_ddp.py checks the persons and batches, tests/test_compat.py what the same processes printed.


@pytest.fixture(scope="session")
def lightning_spawn(ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_with_checkpoints(ds8, tmp_path_factory.mktemp("spawn") / "result.json", *SPAWN_RUN, timeout=SPAWN_S)


@pytest.fixture(scope="session")
def lightning_spawn_resumed(lightning_spawn: Path, ds8: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resume(lightning_spawn, ds8, SPAWN_CKPT, tmp_path_factory.mktemp("spawn-resumed"), *SPAWN_RUN,
                  timeout=SPAWN_S)
