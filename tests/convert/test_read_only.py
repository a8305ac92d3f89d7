"""A dataset on a read-only filesystem (a cluster's shared copy; issue 40), made for real by a read-only bind mount:
everything that only reads works on it (verify, inspect, plan, the readers, `upgrade` with nothing to upgrade), and
what must write refuses in one line, exit 2, naming the directory and the real cause (before: `upgrade` ended in a
traceback at the conversion lock, `convert --overwrite` said the lock "should be a plain file: remove it")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import read_all, shardify, split_ids
from small_disk import error_lines, read_only
from test_convert_full_disk import convert, convert_args, format2

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World

READ_ONLY = "Read-only file system"


@pytest.fixture(scope="module")
def datasets(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding `ds` (the current format) and `old` (format 2: what `upgrade` writes into)."""
    root = tmp_path_factory.mktemp("datasets")
    format2(convert(raw, root / "ds"), root / "old")
    return root


@pytest.fixture
def ro(datasets: Path, tmp_path: Path) -> Iterator[Path]:
    with read_only(datasets, tmp_path / "ro") as where:
        yield where


def refused(text: str, where: Path) -> str:
    """The one error line of a refused write, naming ``where`` and the read-only filesystem, and no other advice."""
    lines = error_lines(text)
    assert len(lines) == 1 and f"error: {where}" in lines[0] and READ_ONLY in lines[0], text
    assert "Traceback" not in text and "free space" not in text and "remove it" not in text, text
    return lines[0]


def test_what_only_reads_works_on_a_read_only_dataset(ro: Path) -> None:
    ds = ro / "ds"
    before = sorted(p.relative_to(ds) for p in ds.rglob("*"))
    for args in (["verify", ds], ["inspect", ds], ["plan", ds, "--workers", "1", "--batch-size", "64"],
                 ["plan", ds, "--workers", "1", "--tokens-per-batch", "8192"], ["upgrade", ds]):
        code, text = shardify(*args)
        assert code == 0 and "Traceback" not in text, (args, text)
    shards, rem = split_ids(ds, "train")
    persons = sum(len(s) for s in shards) + len(rem)
    assert sum(len(b["person_id"]) for b in read_all(ds)) == persons
    loader = ShardedLoader(ShardedDataset(ds, world=World(0, 1), num_workers=1, tokens_per_batch=8192),
                           persistent_workers=False)
    assert sum(len(b["person_id"]) for b in loader) == persons
    assert sorted(p.relative_to(ds) for p in ds.rglob("*")) == before  # nothing written, no lock file made


def test_upgrade_that_must_write_refuses_naming_the_directory(ro: Path) -> None:
    code, text = shardify("upgrade", ro / "old")
    assert code == 2, text
    line = refused(text, ro / "old")
    assert "not upgraded" in line and "write to a writable directory" in line, line


def test_convert_into_a_read_only_place_refuses_naming_it(raw: Path, ro: Path) -> None:
    for out, more in ((ro / "ds", ["--overwrite"]), (ro / "new", [])):
        code, text = shardify(*convert_args(raw, out, *more))
        assert code == 2, text
        assert "nothing converted" in refused(text, out)
    assert not (ro / "new").exists()

