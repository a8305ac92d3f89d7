"""`shardify` starts fast: importing the CLI (or the package) loads no torch, webdataset or Lightning, and
`--help` costs under 0.5 s of CPU; the package's public names still load on first use."""

from __future__ import annotations

import inspect
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import repo_first, scaled, shardify

import lifeseq_shards
from lifeseq_shards import datamodule, reader

HEAVY = {"torch", "webdataset", "lightning", "pytorch_lightning"}
# the child imports this checkout, whatever is installed
ENV = repo_first(os.environ)


def imported_by(statement: str) -> set[str]:
    """Every module a fresh interpreter imports to run ``statement``, as ``-X importtime`` lists them."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True,
                       env=ENV, timeout=scaled(120), check=True)
    return {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("statement", ["import lifeseq_shards.cli", "import lifeseq_shards"])
def test_import_loads_no_heavy_module(statement: str) -> None:
    modules = imported_by(statement)
    assert statement.split()[1] in modules  # the listing was read
    assert not {m.split(".")[0] for m in modules} & HEAVY, sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("statement", ["import lifeseq_shards.cli", "import lifeseq_shards.store.manifest"])
def test_the_cli_and_the_manifest_load_no_io_edge(statement: str) -> None:
    """Remote reads (curl and ``pipe:`` commands) are lifeseq_shards.store.remote's alone: parsing a manifest, or
    ``shardify --help``, starts no subprocess machinery."""
    modules = imported_by(statement)
    assert statement.split()[1] in modules  # the listing was read
    io_edge = modules & {"subprocess", "lifeseq_shards.store.remote"}
    assert not io_edge, sorted(io_edge)


def child_cpu_seconds(args: list[str]) -> float:
    """User + system CPU of one ``shardify ARGS`` run (the console script's own two lines)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-c", "import sys; from lifeseq_shards.cli import main; sys.exit(main())",
                        *args], capture_output=True, text=True, env=ENV, timeout=scaled(120))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0 and "Usage:" in r.stdout, r.stderr
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["embeddings", "verify", "--help"]], ids=" ".join)
def test_help_costs_under_half_a_second_of_cpu(args: list[str]) -> None:
    best = min(child_cpu_seconds(args) for _ in range(3))  # best of 3: other processes share the machine
    assert best < 0.5, f"shardify {' '.join(args)}: {best:.2f} s of CPU"


def test_public_names_load_on_first_use() -> None:
    from lifeseq_shards import DatasetChanged, EmbeddingWriter, LifeSeqDataModule, ShardedDataset, ShardedLoader
    from lifeseq_shards.embed.writer import EmbeddingWriter as defined

    assert EmbeddingWriter is defined
    assert (DatasetChanged, ShardedDataset, ShardedLoader) == (reader.DatasetChanged, reader.ShardedDataset,
                                                                reader.ShardedLoader)
    assert LifeSeqDataModule is datamodule.LifeSeqDataModule
    assert set(lifeseq_shards.__all__) == {"DatasetChanged", "DeviceMetrics", "EmbeddingWriter", "LifeSeqData",
                                           "LifeSeqDataModule", "ShardedDataset", "ShardedLoader"}
    assert set(lifeseq_shards.__all__) <= set(dir(lifeseq_shards))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lifeseq_shards.Nope  # noqa: B018


def test_python_dash_m_runs_the_cli(tmp_path: Path) -> None:
    """`python -m lifeseq_shards.cli` is `shardify` (it printed nothing and exited 0: a command that seemed to work)."""
    r = subprocess.run([sys.executable, "-m", "lifeseq_shards.cli", "plan", str(tmp_path), "--batch-size", "4"],
                       capture_output=True, text=True, env=ENV, timeout=scaled(120))
    assert r.returncode == 2 and str(tmp_path) in r.stderr + r.stdout


def test_version_is_the_package_version() -> None:
    import tomllib

    version = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    code, out = shardify("--version")
    assert code == 0 and out.strip() == f"shardify, version {version}", out


def test_plan_plans_the_front_ends_default_workers(nomlm_dataset: Path) -> None:
    """`shardify plan` without --workers plans what LifeSeqDataModule / LifeSeqData read without num_workers= (it
    planned 0 workers, they read with 2)."""
    from lifeseq_shards import LifeSeqData, LifeSeqDataModule

    defaults = {inspect.signature(c).parameters["num_workers"].default for c in (LifeSeqData, LifeSeqDataModule)}
    assert len(defaults) == 1
    code, out = shardify("plan", nomlm_dataset, "--batch-size", 64)
    assert f"= 1 ranks; {defaults.pop()} worker(s) per rank" in out, out
