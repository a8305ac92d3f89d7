"""Every block the reader reads is the one the manifest names (issue 20): a later block of a shard swapped for
another shard's block, for a block of another conversion of the same input, or for a copy of the shard's own block
0 fails the epoch in one line naming the shard and the block, before a wrong person is yielded, locally, over
http(s) and through a `pipe:` command. Before, each was read on: the block's persons twice, the swapped-out block's
never. A dataset without the blocks' checksums (formats 1-3) is refused with the command that adds them. Whole
shards copied over others, a schema edited under the blocks, and counts lowered are refused the same way."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    ManifestJSON,
    copy_of,
    edit_manifest,
    read_all,
    serve_directory,
    shardify,
    swap_fields,
    to_format2,
)

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.store.manifest import ManifestError, fingerprint, parse_manifest
from lifeseq_shards.store.shardfile import iter_tar_members, sha256_file, tar_member

SHARD, BLOCK = "train/shard-000003.tar", 3  # a full block in the middle of an 8-block shard


@pytest.fixture(scope="module")
def sound(blocks16: Path) -> list[dict[str, torch.Tensor]]:
    return list(epoch(blocks16))


@pytest.fixture
def copy(blocks16: Path, tmp_path: Path) -> Path:
    shutil.copytree(blocks16, tmp_path / "ds")
    return tmp_path / "ds"


def members(path: Path) -> list[bytes]:
    with open(path, "rb") as fh:
        return [data for _, data in iter_tar_members(fh)]


def put_block(shard: Path, index: int, data: bytes) -> None:
    """The shard rewritten with ``data`` as block ``index``: a valid tar, the member under its own name."""
    blocks = members(shard)
    assert blocks[index] != data
    blocks[index] = data
    shard.write_bytes(b"".join(tar_member(f"{i:06d}.block.zst", d) for i, d in enumerate(blocks)) + bytes(1024))


# the three swaps of the issue: (dataset, reseeded dataset) -> the block put in the place of SHARD's block BLOCK
SWAPS: dict[str, Callable[[Path, Path], bytes]] = {
    "another shard's block": lambda ds, _: members(ds / "train" / "shard-000005.tar")[BLOCK],
    "another conversion's block": lambda _, other: members(other / SHARD)[BLOCK],
    "the shard's own block 0": lambda ds, _: members(ds / SHARD)[0],
}


def epoch(root: Path | str, workers: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    ds = ShardedDataset(root, batch_size=100, world=World(0, 1), num_workers=workers)
    return iter(ShardedLoader(ds, persistent_workers=False) if workers else ds)


def read_until_refused(root: Path | str, workers: int = 0) -> tuple[list[dict[str, torch.Tensor]], str]:
    got: list[dict[str, torch.Tensor]] = []
    with pytest.raises(OSError) as err:
        for batch in epoch(root, workers):
            got.append(batch)
    return got, str(err.value)


def assert_refused_before_a_wrong_person(got: list[dict[str, torch.Tensor]], message: str,
                                         sound: list[dict[str, torch.Tensor]], line: str = "") -> None:
    """``line``: what precedes the reader's one line (torch's worker traceback ends with "OSError: " and it)."""
    assert re.fullmatch(rf"{re.escape(line)}[^\n]*{re.escape(SHARD)}: block {BLOCK}: not the block the manifest names "
                        r"\(its checksum differs: a block of another shard or conversion, or another block of this "
                        r"shard, in its place\)", message.strip().splitlines()[-1] if line else message), message
    assert len(got) < len(sound)
    for a, b in zip(got, sound, strict=False):  # what came before the refusal is the sound epoch's, person for person
        assert torch.equal(a["person_id"], b["person_id"])


@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_swapped_block_fails_the_epoch_naming_shard_and_block(copy: Path, reseeded16: Path, swap: str,
                                                               sound: list[dict[str, torch.Tensor]]) -> None:
    """Before: the epoch read on, 16 persons twice (or 16 of another split and shuffle) and 16 never."""
    put_block(copy / SHARD, BLOCK, SWAPS[swap](copy, reseeded16))
    got, message = read_until_refused(copy)
    assert_refused_before_a_wrong_person(got, message, sound)
    code, out = shardify("verify", str(copy))
    assert code == 1 and f"{SHARD}: {BLOCK:06d}.block.zst: not the block the manifest names" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["http", "pipe", "workers"])
def test_remote_reads_and_workers_check_every_block_too(copy: Path, transport: str,
                                                        sound: list[dict[str, torch.Tensor]]) -> None:
    put_block(copy / SHARD, BLOCK, SWAPS["the shard's own block 0"](copy, copy))
    if transport == "http":
        with serve_directory(copy) as url:
            got, message = read_until_refused(url)
    elif transport == "pipe":
        got, message = read_until_refused(f"pipe:cat {copy}/{{}}")
    else:
        got, message = read_until_refused(copy, workers=2)
    assert_refused_before_a_wrong_person(got, message, sound, "OSError: " if transport == "workers" else "")


def older(version: int) -> Callable[[dict[str, Any]], None]:
    """A manifest as the converter wrote it in format 2 or 3: without the blocks' checksums."""
    def change(m: dict[str, Any]) -> None:
        if version == 2:
            to_format2(m)
        m["format_version"] = version
        for info in m["splits"].values():
            for e in [*info["shards"], info["remainder"] or {}]:
                e.pop("block_checksums", None)
    return change


def edit(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((root / "manifest.json").read_text())
    change(m)
    (root / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_dataset_is_refused_with_the_command_that_upgrades_it(copy: Path, blocks16: Path, version: int,
                                                                       sound: list[dict[str, torch.Tensor]]) -> None:
    """Before: read without a check of its blocks (format 2: not even the first's). After `shardify upgrade` it reads
    as before; a format-3 dataset's manifest becomes byte for byte the one the converter writes now."""
    edit(copy, older(version))
    with pytest.raises(ManifestError) as err:
        ShardedDataset(copy, batch_size=100, world=World(0, 1))
    assert str(err.value) == (f"{copy}: a format-{version} dataset without per-block checksums (a block swapped "
                              f"inside a shard would be read without a word): run `shardify upgrade {copy}` to "
                              "verify it and add them")
    with pytest.raises(ManifestError, match=r"run `shardify upgrade DIR` where its files are to verify it"):
        ShardedDataset(f"pipe:cat {copy}/{{}}", batch_size=100, world=World(0, 1))
    blocks = sum(-(-e["samples"] // 16) for info in json.loads((copy / "manifest.json").read_text())["splits"].values()
                 for e in [*info["shards"], info["remainder"] or {"samples": 0}])
    code, out = shardify("verify", str(copy))
    assert code == 1 and f"manifest: format {version}, without per-block checksums: the reader refuses it; " \
                         f"`shardify upgrade {copy}` adds them\n" in out, out
    code, out = shardify("upgrade", str(copy))
    assert code == 0 and f"{copy}: OK; format {4 if version == 3 else version} with the checksums of its {blocks} " \
                         "blocks and the lengths indexes lengths/train.u16, lengths/val.u16\n" in out, out
    assert shardify("verify", str(copy))[0] == 0
    got = list(epoch(copy))
    assert len(got) == len(sound)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, sound, strict=True))
    if version == 3:
        assert (copy / "manifest.json").read_text() == (blocks16 / "manifest.json").read_text()


def test_upgrade_finds_a_block_swapped_since_the_conversion(copy: Path) -> None:
    """The checksums are taken from shards whose sha256 the manifest vouches for: a swapped block is not blessed."""
    edit(copy, older(2))
    before = (copy / "manifest.json").read_text()
    put_block(copy / SHARD, BLOCK, members(copy / SHARD)[0])
    code, out = shardify("upgrade", str(copy))
    assert code == 1 and f"{SHARD}: sha256 differs from the manifest" in out and "not upgraded" in out, out
    assert (copy / "manifest.json").read_text() == before
    code, out = shardify("upgrade", "http://127.0.0.1:9/ds")
    assert code == 2 and out.count("\n") == 1 and "upgrade re-hashes the shards on the local disk" in out, out


NOT_HEX = r"splits\.train\.shards\[0\]\.block_checksums is '.*', not 8 lowercase hex digits a block"


@pytest.mark.parametrize(("change", "needle"), [
    (lambda e: e.update(block_checksums=e["block_checksums"][:-1]), NOT_HEX),
    (lambda e: e.update(block_checksums=e["block_checksums"].upper()), NOT_HEX),
    (lambda e: e.update(block_checksums=None), NOT_HEX),
    (lambda e: e.pop("block_checksums"), NOT_HEX),
    (lambda e: e.update(head_checksum=(e["head_checksum"] + 1) % (1 << 32)),
     r"splits\.train\.shards\[0\]\.head_checksum is not its first block's checksum in block_checksums"),
])
def test_block_checksums_that_cannot_be_are_one_line(blocks16: Path, change: Callable[[dict[str, Any]], object],
                                                     needle: str) -> None:
    m = json.loads((blocks16 / "manifest.json").read_text())
    change(m["splits"]["train"]["shards"][0])
    with pytest.raises(ManifestError, match=r"^manifest\.json: " + needle):
        parse_manifest(json.dumps(m))


def test_a_block_without_its_checksum_is_refused(copy: Path) -> None:
    """A manifest that lists fewer checksums than the shard has blocks: the block without one is not read."""
    edit(copy, lambda m: m["splits"]["train"]["shards"][3].update(
        block_checksums=m["splits"]["train"]["shards"][3]["block_checksums"][:-8]))
    with pytest.raises(OSError, match=rf"^\S+/{re.escape(SHARD)}: block 7: the manifest lists 7 block checksums, no "
                                      "checksum for it$"):
        list(epoch(copy))
    code, out = shardify("verify", str(copy))
    assert code == 1 and f"{SHARD}: the manifest lists 7 block checksums, its 115 persons in blocks of 16 make 8 " \
                         "blocks" in out, out


# -- whole shards and counts that are not the manifest's --------------------------------------------------------------
def test_a_shard_copied_over_another_is_refused(nomlm_copy: Path) -> None:
    """Before: shard 3's persons read twice, shard 7's never."""
    shutil.copy(nomlm_copy / "train" / "shard-000003.tar", nomlm_copy / "train" / "shard-000007.tar")
    with pytest.raises(OSError, match=r"train/shard-000007\.tar: block 0: not the shard the manifest names"):
        read_all(nomlm_copy)


def test_a_same_named_shard_from_another_conversion_is_refused(nomlm_copy: Path, reseeded: Path) -> None:
    """Before: read without a word (115 persons of another split and shuffle)."""
    shutil.copy(reseeded / "train" / "shard-000003.tar", nomlm_copy / "train" / "shard-000003.tar")
    with pytest.raises(OSError, match=r"train/shard-000003\.tar: block 0: not the shard the manifest names"):
        read_all(nomlm_copy)


@pytest.mark.parametrize("fields", [("age", "segment"), ("tokens", "masked_tokens")])
def test_a_schema_with_swapped_fields_is_refused(mlm_dataset: Path, tmp_path: Path, fields: tuple[str, str]) -> None:
    """Before: every person's values read into the other field. The fingerprint is refitted, so only the blocks'
    schema tag tells; verify says so too."""
    ds = copy_of(mlm_dataset, tmp_path)
    edit_manifest(ds, swap_fields(*fields), refit=True)
    with pytest.raises(OSError, match=r"shard-\d+\.tar: block 0: block written with another schema"):
        read_all(ds)
    code, out = shardify("verify", str(ds))
    assert code == 1 and "block written with another schema" in out


def test_lowered_counts_are_refused(nomlm_copy: Path) -> None:
    """Before: 15 persons of each 115-person shard silently not read (13 %)."""
    def lower(m: ManifestJSON) -> None:
        info = m["splits"]["train"]
        for e in info["shards"]:
            e["samples"] = 100
        info["shard_persons"], info["persons"] = 100, info["persons"] - 15 * len(info["shards"])

    edit_manifest(nomlm_copy, lower)
    with pytest.raises(OSError, match=r"shard-\d+\.tar: block 0: 115 persons, where the manifest's 100 persons"):
        read_all(nomlm_copy)


def test_counts_lowered_by_whole_blocks_are_refused(blocks16: Path, tmp_path: Path) -> None:
    """115 -> 112 persons: 7 whole blocks of 16, so every block read holds what the manifest says; the shard's
    8th block, which the manifest does not have, gives it away."""
    ds = copy_of(blocks16, tmp_path)

    def lower(m: ManifestJSON) -> None:
        for e in m["splits"]["train"]["shards"]:
            e["samples"] = 112

    edit_manifest(ds, lower)
    with pytest.raises(OSError, match=r"block 7: more blocks than the manifest's 112 persons in blocks of 16 make"):
        read_all(ds)


def test_a_manifest_edited_to_match_a_spliced_block_is_read_but_verify_names_it(copy: Path, blocks16: Path) -> None:
    """What docs/reference/format.md says the reader does not check: the fingerprint covers the schema and the
    shards' sha256, not their block checksums, so a block copied in with its checksum copied into the manifest reads
    as the conversion's (here the shard's own block 0 twice, block BLOCK never). `verify` names the shard by its
    sha256, and, with the sha256, byte count and fingerprint edited to match as well, by the persons it repeats."""
    spliced = members(copy / SHARD)[0]
    put_block(copy / SHARD, BLOCK, spliced)

    def splice_checksum(m: dict[str, Any]) -> None:
        e = next(e for e in m["splits"]["train"]["shards"] if e["file"] == SHARD)
        e["block_checksums"] = e["block_checksums"][: 8 * BLOCK] + e["block_checksums"][:8] + \
            e["block_checksums"][8 * (BLOCK + 1) :]

    edit(copy, splice_checksum)
    assert sum(len(b["person_id"]) for b in epoch(copy)) == sum(len(b["person_id"]) for b in epoch(blocks16))
    code, out = shardify("verify", str(copy))
    assert code == 1 and f"{SHARD}: sha256 differs from the manifest" in out, out

    def vouch_for_the_file(m: dict[str, Any]) -> None:
        e = next(e for e in m["splits"]["train"]["shards"] if e["file"] == SHARD)
        e["sha256"], e["bytes"] = sha256_file(copy / SHARD), (copy / SHARD).stat().st_size
        entries = [e for info in m["splits"].values() for e in [*info["shards"], *filter(None, [info["remainder"]])]]
        m["fingerprint"] = fingerprint(parse_manifest(json.dumps(m)).schema, [e["sha256"] for e in entries])

    edit(copy, vouch_for_the_file)
    code, out = shardify("verify", str(copy))
    assert code == 1 and re.search(rf"{re.escape(SHARD)}: {BLOCK:06d}\.block\.zst: person \d+ \(record 0\) appears "
                                   "twice", out), out
