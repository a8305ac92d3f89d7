"""The output directory (lifeseq_shards/convert/outdir.py): `--overwrite` removes only what the old manifest lists
and keeps the old dataset until the new one is complete, on one filesystem or two; a second conversion into the same
directory is refused; a conversion killed while it replaces the old files leaves no dataset, and its rerun clears
only what was its own."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import scaled, shardify, wait_for
from small_inputs import assert_refused, hooked, person_ids, write_h5

from lifeseq_shards.store.remote import read_manifest


def listed(root: Path) -> set[str]:
    return set(read_manifest(root).files())


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """40 persons (ids 100..139) in 4 train and 4 val shards, beside a user's own files."""
    out = tmp_path / "ds"
    code, text = shardify("convert", write_h5(tmp_path / "old.h5", n=40), "-o", out, "--num-val", 4, "--shards", 4)
    assert code == 0, text
    for own in ("all/embeddings.npy", "train/notes.txt", "README.txt"):
        (out / own).parent.mkdir(exist_ok=True)
        (out / own).write_text("mine")
    return out


def test_overwrite_removes_only_the_old_datasets_files(dataset: Path, tmp_path: Path) -> None:
    old = listed(dataset)
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite")
    assert code == 0, text
    for own in ("all/embeddings.npy", "train/notes.txt", "README.txt"):
        assert (dataset / own).read_text() == "mine"
    new = listed(dataset)
    assert not [f for f in old - new if (dataset / f).exists()]  # train/shard-000002.tar and the like are gone
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert {p.name for p in dataset.iterdir()} == {"manifest.json", "train", "val", "lengths", "all", "README.txt",
                                                   ".conversion.lock"}


def test_failed_overwrite_keeps_the_old_dataset(dataset: Path, tmp_path: Path) -> None:
    before = (dataset / "manifest.json").read_text()
    bad = write_h5(tmp_path / "dup.h5", sequence_id=np.array([1, 2, 1, 3]))
    assert_refused(*shardify("convert", bad, "-o", dataset, "--overwrite"), "person id 1 occurs 2 times")
    assert (dataset / "manifest.json").read_text() == before
    assert shardify("verify", dataset)[0] == 0 and person_ids(dataset) == list(range(100, 140))
    assert not (dataset / ".conversion-staging").exists()


def _file_entry(path: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        m = json.loads(text)
        m["splits"]["train"]["shards"][0]["file"] = path
        return json.dumps(m)
    return edit


MANIFEST_EDITS = {
    "../victim.txt": (_file_entry("../victim.txt"), "'../victim.txt', outside the dataset's own files"),
    "absolute path": (lambda t: t.replace('"train/shard-000000.tar"', '"/victim.txt"'), "'/victim.txt', outside"),
    "not JSON": (lambda t: t[: len(t) // 2], "manifest.json: cannot tell which files it lists"),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_overwrite_refuses_a_manifest_it_cannot_trust(edit: str, dataset: Path, tmp_path: Path) -> None:
    """--overwrite deletes what the old manifest lists: never a path that leaves the dataset, nothing when unsure."""
    change, message = MANIFEST_EDITS[edit]
    (dataset / "manifest.json").write_text(change((dataset / "manifest.json").read_text()))
    assert_refused(*shardify("convert", write_h5(tmp_path / "new.h5"), "-o", dataset, "--overwrite"), message)
    assert (dataset / "train" / "shard-000000.tar").exists() and (dataset / "manifest.json").exists()


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory on another filesystem than tmp_path: /dev/shm where it is a tmpfs of its own."""
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="lifeseq-scratch-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_overwrite_with_a_split_directory_on_another_filesystem(dataset: Path, scratch: Path, tmp_path: Path) -> None:
    """train/ a symlink to scratch space: the old shards were deleted, then the rename failed (EXDEV, exit 1), no
    manifest left, and every rerun failed the same way."""
    shutil.move(dataset / "train", scratch / "train")
    (dataset / "train").symlink_to(scratch / "train")
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite")
    assert code == 0, text
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert (dataset / "train").is_symlink() and (dataset / "train/notes.txt").read_text() == "mine"
    assert {p.name for p in scratch.rglob("*")} == {"train", "notes.txt"} | {
        Path(f).name for f in listed(dataset) if f.startswith("train/")}  # no staging copies, no old shards
    assert not (dataset / ".conversion-staging").exists()


def test_overwrite_that_cannot_copy_onto_the_other_filesystem_keeps_the_old_dataset(
        dataset: Path, scratch: Path, tmp_path: Path) -> None:
    shutil.move(dataset / "train", scratch / "train")
    (dataset / "train").symlink_to(scratch / "train")
    before = (dataset / "manifest.json").read_text()
    (scratch / "train" / ".conversion-staging").write_text("a file where the copies go")  # the copy fails
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    assert_refused(*shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2, "--overwrite"),
                   "cannot copy the new shard onto its filesystem", "the old dataset is kept")
    assert (dataset / "manifest.json").read_text() == before
    assert shardify("verify", dataset)[0] == 0 and person_ids(dataset) == list(range(100, 140))


def test_a_lock_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    """Before: an IsADirectoryError traceback, exit 1."""
    (tmp_path / "ds" / ".conversion.lock").mkdir(parents=True)
    assert_refused(*shardify("convert", write_h5(tmp_path / "a.h5"), "-o", tmp_path / "ds"),
                   ".conversion.lock: cannot open the conversion lock")


# -- processes (slow: real subprocess conversions) ----------------------------------------------------------------
# the first pass waits for report/go: the conversion holds its directory meanwhile
HOLD = """
real = c.encode_pass
def held(*a, **k):
    (report / "started").touch()
    while not (report / "go").exists():
        time.sleep(0.05)
    return real(*a, **k)
c.encode_pass = held
"""

@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_second_conversion_into_the_same_directory_is_refused(overwrite: list[str], tmp_path: Path) -> None:
    out, report = tmp_path / "ds", tmp_path / "report"
    first = hooked(HOLD, report, "convert", write_h5(tmp_path / "a.h5"), "-o", out)
    try:
        assert wait_for(lambda: (report / "started").exists(), 60), first.stderr
        assert_refused(*shardify("convert", write_h5(tmp_path / "b.h5", n=5), "-o", out, *overwrite),
                       f"{out}: another conversion is writing to it")
        (report / "go").touch()
        assert first.wait(scaled(60)) == 0, first.stderr.read()  # type: ignore[union-attr]
    finally:
        first.kill()
    assert shardify("verify", out)[0] == 0 and person_ids(out) == [100, 101, 102, 103]


# dies while moving the new shards in (the old files are gone, one new shard is in place)
DIE_REPLACING = """
real = os.replace
def dying(src, dst):
    if ".conversion-staging" in str(src) and str(src).endswith("shard-000001.tar"):
        os._exit(9)
    return real(src, dst)
os.replace = dying
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_while_replacing_leaves_no_dataset_and_rerun_clears_only_ours(dataset: Path, tmp_path: Path) -> None:
    new_input = write_h5(tmp_path / "new.h5", n=40, sequence_id=np.arange(500, 540))
    proc = hooked(DIE_REPLACING, tmp_path / "report", "convert", new_input, "-o", dataset, "--num-val", 2,
                  "--shards", 2, "--overwrite")
    assert proc.wait(scaled(60)) == 9, proc.stderr.read()  # type: ignore[union-attr]
    assert not (dataset / "manifest.json").exists() and shardify("verify", dataset)[0] == 2
    code, text = shardify("convert", new_input, "-o", dataset, "--num-val", 2, "--shards", 2)  # no --overwrite needed
    assert code == 0, text
    assert person_ids(dataset) == list(range(500, 540)) and shardify("verify", dataset)[0] == 0
    assert {str(p.relative_to(dataset)) for p in dataset.rglob("*") if p.is_file()} == listed(dataset) | {
        "manifest.json", ".conversion.lock", "all/embeddings.npy", "train/notes.txt", "README.txt"}
