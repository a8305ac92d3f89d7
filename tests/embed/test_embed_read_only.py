"""Embeddings and read-only or missing places (issue 40): a read-only dataset (a read-only bind mount, for real) is
embedded as any other; `merge` into a missing or read-only directory refuses in one line naming the cause and what
to do about it (before: the cause, then "free space")."""

from __future__ import annotations

from pathlib import Path

from embed_helpers import embed_in_process, verify
from helpers import shardify
from small_disk import error_lines, read_only


def test_a_read_only_dataset_is_embedded(ds: Path, tmp_path: Path) -> None:
    with read_only(ds, tmp_path / "ro") as ro:
        embed_in_process(ro, tmp_path / "emb")
        assert verify(tmp_path / "emb", ro)[0] == 0


def merge_refused(done: Path, target: Path, cause: str, remedy: str) -> None:
    code, text = shardify("embeddings", "merge", done, target)
    assert code == 2, text
    lines = error_lines(text)
    assert len(lines) == 1 and f"error: {target}" in lines[0] and cause in lines[0] and remedy in lines[0], text
    assert "nothing merged" in lines[0] and "free space" not in lines[0] and "Traceback" not in text, text


def test_merge_into_a_missing_or_read_only_directory(done: Path, tmp_path: Path) -> None:
    merge_refused(done, tmp_path / "missing" / "all.parquet", "No such file or directory",
                  "its directory does not exist")
    (tmp_path / "out").mkdir()
    with read_only(tmp_path / "out", tmp_path / "ro") as ro:
        merge_refused(done, ro / "all.parquet", "Read-only file system", "write to a writable directory")
