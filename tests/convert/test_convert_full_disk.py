"""A full disk during `convert` or `upgrade` (issue 33): ENOSPC on a small tmpfs, EFBIG under a file-size limit, is
one line naming the file that could not be written and why, exit 2; the staging directory is gone, an old dataset
(`--overwrite`) or an old manifest (`upgrade`) is kept as it was. Before: a traceback from the writer, exit 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import shardify, to_format2
from small_disk import SHARDIFY, error_lines, fill, run_limited, tmpfs

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset


def convert_args(raw: Path, out: Path, *more: str) -> list[object]:
    return ["convert", raw / "sequences.parquet", "--vocab", raw / "vocab.csv", "-o", out, "--shards", "5", *more]


def convert(raw: Path, out: Path) -> Path:
    convert_dataset([str(raw / "sequences.parquet")], out, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=5))
    return out


def assert_one_line(text: str, under: Path, cause: str) -> str:
    lines = error_lines(text)
    assert len(lines) == 1 and f"error: {under}/" in lines[0] and f"cannot write ({cause}" in lines[0], text
    assert "Traceback" not in text, text
    return lines[0]


def test_convert_onto_a_full_filesystem_keeps_the_old_dataset(raw: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small") as small:
        out = convert(raw, small / "ds")
        before = (out / "manifest.json").read_bytes()
        fill(small, 100 << 10)  # room for a shard or two, not a dataset
        code, text = shardify(*convert_args(raw, out, "--overwrite", "--seed", "1"))
        assert code == 2
        line = assert_one_line(text, out, "No space left on device")
        assert "the old dataset is unchanged" in line
        assert (out / "manifest.json").read_bytes() == before
        assert not (out / ".conversion-staging").exists()
        (small / "ballast").unlink()
        assert shardify("verify", out)[0] == 0


@pytest.mark.parametrize("processes", ["1", "2"])
def test_convert_past_a_file_size_limit(raw: Path, tmp_path: Path, processes: str) -> None:
    """EFBIG in the converter's own process or in one of its shard writers (raised there, told here)."""
    out = tmp_path / "ds"
    r = run_limited(SHARDIFY, convert_args(raw, out, "--processes", processes), fsize=32 << 10)
    assert r.returncode == 2, r.stderr[-3000:]
    assert_one_line(r.stderr, out, "File too large")
    assert not (out / "manifest.json").exists() and not (out / ".conversion-staging").exists()


def format2(ds: Path, where: Path) -> Path:
    """A copy of ``ds`` whose manifest lacks the block checksums (what `upgrade` adds)."""
    shutil.copytree(ds, where)
    m = json.loads((where / "manifest.json").read_text())
    to_format2(m)
    (where / "manifest.json").write_text(json.dumps(m, indent=1))
    return where


def test_upgrade_onto_a_full_filesystem_or_past_a_file_size_limit(raw: Path, tmp_path: Path) -> None:
    ds = convert(raw, tmp_path / "ds")
    with tmpfs(tmp_path / "small") as small:
        old = format2(ds, small / "old")
        before = (old / "manifest.json").read_bytes()
        fill(small, 0)
        code, text = shardify("upgrade", old)
        assert code == 2
        assert "not upgraded" in assert_one_line(text, old, "No space left on device")
        assert (old / "manifest.json").read_bytes() == before and not (old / "manifest.json.tmp").exists()
    old = format2(ds, tmp_path / "old")
    r = run_limited(SHARDIFY, ["upgrade", old], fsize=len(before))  # the new manifest is longer
    assert r.returncode == 2, r.stderr[-3000:]
    assert_one_line(r.stderr, old, "File too large")
    assert (old / "manifest.json").read_bytes() == before and not (old / "manifest.json.tmp").exists()
