"""A full disk under the embedding writer or `merge` (issue 33): ENOSPC on a small tmpfs, EFBIG under a file-size
limit, is one line naming the file and why (the CLI: exit 2); no temporary file is left, no file under a final name
is less than whole, and a job started again with room finishes the output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from embed_helpers import embed_in_process, verify
from helpers import shardify
from small_disk import SHARDIFY, error_lines, fill, run_limited, tmpfs

from lifeseq_shards.store.writes import WriteFailed

EMBED = """
sys.path[:0] = [{tests!r}, {tests!r} + '/embed']
from embed_helpers import embed_in_process
try:
    embed_in_process(Path(sys.argv[1]), Path(sys.argv[2]))
except OSError as e:
    print(type(e).__name__, e)
"""


def leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_the_writer_on_a_full_filesystem_names_the_file_and_a_rerun_finishes(ds: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small") as small:
        fill(small, 48 << 10)  # the manifest and two or three of the 11 files (about 16 KiB each)
        with pytest.raises(WriteFailed, match=r"emb/(train|val)/[\w-]+\.parquet: cannot write \(No space left on "
                                              r"device\); its \d+ persons are not kept"):
            embed_in_process(ds, small / "emb")
        assert not leftovers(small / "emb")
        (small / "ballast").unlink()
        embed_in_process(ds, small / "emb")  # resumes: every file there is whole
        assert verify(small / "emb", ds)[0] == 0


# The limit starts at the writer's first write: the loader's shared-memory control block (a file in /dev/shm, over
# 8 KiB) is made before, and would meet the limit first.
LIMIT_AT_FIRST_WRITE = """
from lifeseq_shards.embed.writer import EmbeddingWriterHooks
unlimited = EmbeddingWriterHooks.write
def write(self, *args, **kwargs):
    limit()
    return unlimited(self, *args, **kwargs)
EmbeddingWriterHooks.write = write
"""


def test_the_writer_past_a_file_size_limit(ds: Path, tmp_path: Path) -> None:
    tests = str(Path(__file__).resolve().parents[1])
    r = run_limited("from pathlib import Path\n" + LIMIT_AT_FIRST_WRITE + EMBED.format(tests=tests),
                    [ds, tmp_path / "emb"], fsize=8 << 10, now=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("WriteFailed ") and ".parquet: cannot write (File too large)" in r.stdout, r.stdout
    assert not leftovers(tmp_path / "emb") and not list((tmp_path / "emb").rglob("*.parquet"))


def test_merge_onto_a_full_filesystem_or_past_a_file_size_limit(done: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small") as small:
        fill(small, 16 << 10)  # the merged table is about 100 KiB
        code, text = shardify("embeddings", "merge", done, small / "all.parquet")
        assert code == 2, text
        lines = error_lines(text)
        assert len(lines) == 1 and f"{small / 'all.parquet'}: cannot write (" in lines[0], text
        assert "nothing merged" in lines[0]
        assert sorted(p.name for p in small.iterdir()) == ["ballast"]
    out = tmp_path / "emb"
    shutil.copytree(done, out)
    r = run_limited(SHARDIFY, ["embeddings", "merge", out, tmp_path / "all.parquet"], fsize=16 << 10)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and f"{tmp_path / 'all.parquet'}: cannot write (" in lines[0], r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("all.parquet")]
