"""The seed's encoded .h5 files as converter input: what cannot be stored exactly, or is not what the converter
reads, is refused in one line naming file, row and dataset (exit 2), and nothing that looks finished is left."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import shardify
from small_inputs import assert_refused, write_h5

H5_CASES: dict[str, tuple[dict[str, np.ndarray], list[str]]] = {
    "id NaN": ({"sequence_id": np.array([100, np.nan, 102, 103])}, ["row 1", "sequence_id", "nan"]),
    "uint64 id >= 2^63": ({"sequence_id": np.array([100, 2**63, 102, 103], np.uint64)}, ["row 1", str(2**63)]),
    "float abspos": ({"input_ids": np.where(np.arange(4)[:, None, None] == 2, 100.7, 0) + np.zeros((4, 4, 8))},
                     ["row 2", "input_ids", "100.7"]),
    "row without tokens": ({"padding_mask": (np.arange(8) < 3) * (np.arange(4) != 2)[:, None]},
                           ["row 2", "person 102", "no tokens"]),
    "input_ids of 2 dims": ({"input_ids": np.zeros((4, 8), np.int64)}, ["input_ids has shape (4, 8)"]),
    "padding_mask of another width": ({"padding_mask": np.ones((4, 6), np.int64)}, ["padding_mask has shape (4, 6)"]),
    "fewer input_ids rows than ids": ({"sequence_id": np.arange(100, 105)}, ["sequence_id has shape (5,)"]),
    "ids as strings": ({"sequence_id": np.array([b"a", b"b", b"c", b"d"])}, ["sequence_id holds |S1"]),
}


@pytest.mark.parametrize("case", H5_CASES)
def test_h5_input_refused(case: str, tmp_path: Path) -> None:
    override, parts = H5_CASES[case]
    path = write_h5(tmp_path / "in.h5", **override)
    code, out = shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0)
    assert_refused(code, out, str(path), *parts)


def mlm_targets(n: int = 4, width: int = 10, **at: tuple[int, int]) -> dict[str, np.ndarray]:
    """The seed's offline-MLM datasets for ``write_h5`` rows of 3 tokens: no target in any row but the rows named
    ``rowR=(position, true token)``, each with that one target."""
    slots = int(0.3 * width)
    pos, tok = np.full((n, width), -1), np.full((n, width), -1)
    pos[:, :slots], tok[:, :slots] = width - 1, 0
    for key, (p, t) in at.items():
        pos[int(key[3:]), 0], tok[int(key[3:]), 0] = p, t
    return {"target_pos": pos, "target_tokens": tok, "target_cls": np.zeros(n, np.int64)}


def test_mlm_targets_helper_converts(tmp_path: Path) -> None:
    """The offline-MLM rows the refusals below start from are accepted (a target inside the sequence)."""
    path = write_h5(tmp_path / "in.h5", width=10, **mlm_targets(row1=(1, 5)))
    code, out = shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0)
    assert code == 0, out
    assert shardify("verify", tmp_path / "out")[0] == 0


def test_mlm_target_past_the_sequence_refused(tmp_path: Path) -> None:
    """A target position at or past the row's real tokens (what verify refuses) is refused by the converter, not
    written into a dataset that `verify` then calls broken."""
    path = write_h5(tmp_path / "in.h5", width=10, **mlm_targets(row2=(7, 5)))
    assert_refused(*shardify("convert", path, "-o", tmp_path / "out", "--val-fraction", 0),
                   str(path), "row 2", "person 102", "target_pos 7", "3 tokens")
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("dataset, override", [
    ("original_sequence", {}),
    ("input_ids", {"row2": (1, 5)}),  # the masked ids (row 0 of input_ids) of an offline-MLM file
    ("target_tokens", {"row2": (1, 50)}),
])
def test_h5_token_outside_the_vocabulary_refused(dataset: str, override: dict[str, tuple[int, int]], small_vocab: Path,
                                                  tmp_path: Path) -> None:
    """With --vocab the manifest records its size, which the masker and the model's embedding take as the bound of
    every token id: an id at or beyond it is refused (it used to convert, and only `verify` found it)."""
    ids = np.zeros((4, 4, 10), dtype=np.int64)
    ids[:, 0, :3] = [1, 5, 2]
    orig = ids[:, 0].copy()
    if dataset == "original_sequence":
        orig[2, 1] = ids[2, 0, 1] = 50
    if dataset == "input_ids":
        ids[2, 0, 1] = 50
    mlm = mlm_targets(**override) if override else {}
    path = write_h5(tmp_path / "in.h5", width=10, input_ids=ids, original_sequence=orig, **mlm)
    assert_refused(*shardify("convert", path, "--vocab", small_vocab, "-o", tmp_path / "out", "--val-fraction", 0),
                   str(path), "row 2", "person 102", dataset, "token id 50", "vocabulary of 10")
    code, out = shardify("convert", path, "-o", tmp_path / "no-vocab", "--val-fraction", 0)  # no bound to check
    assert code == 0, out
