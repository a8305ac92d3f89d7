"""The per-run stamps prototype (tools/bench_stamps.py) must hold the same persons, or its numbers mean nothing:
expanding each run back over its tokens gives the shards' per-token abspos / age / segment exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_stamps  # noqa: E402

from lifeseq_shards.format import decode_member, iter_tar_members, read_manifest, schema_from_json  # noqa: E402

pytestmark = pytest.mark.bench


def test_runs_expand_to_the_per_token_stamps(nomlm_dataset: Path) -> None:
    m = read_manifest(nomlm_dataset)
    schema = schema_from_json(m["schema"])
    runs_total = tokens_total = 0
    for entry in m["splits"]["train"]["shards"][:6]:
        with open(nomlm_dataset / entry["file"], "rb") as fh:
            for _, data in iter_tar_members(fh):
                block = decode_member(data, schema)
                runs = bench_stamps.runs_of(block)
                assert runs["n_runs"].sum() == len(runs["run_length"])
                assert runs["run_length"].sum() == len(block.columns["tokens"])
                # runs never cross persons: each person's run lengths add up to its length
                per_person = np.add.reduceat(runs["run_length"].astype(np.int64),
                                             np.cumsum(runs["n_runs"], dtype=np.int64) - runs["n_runs"])
                np.testing.assert_array_equal(per_person, block.columns["length"])
                for f in bench_stamps.STAMPS:
                    np.testing.assert_array_equal(np.repeat(runs[f], runs["run_length"]), block.columns[f])
                runs_total += len(runs["run_length"])
                tokens_total += len(block.columns["tokens"])
    assert tokens_total / runs_total > 3  # the sample's events hold several tokens: the prototype has runs to merge


def test_a_run_ends_at_a_person_and_at_any_stamp_change() -> None:
    """Two persons with the same stamps stay two runs; a change of segment alone starts a run."""
    from lifeseq_shards.format import Block

    block = Block({
        "person_id": np.array([7, 8], dtype=np.int64),
        "length": np.array([3, 2], dtype=np.uint16),
        "tokens": np.array([5, 6, 7, 8, 9], dtype=np.uint16),
        "abspos": np.array([10, 10, 10, 10, 10], dtype=np.int16),
        "age": np.array([30, 30, 30, 30, 30], dtype=np.uint8),
        "segment": np.array([2, 1, 1, 1, 1], dtype=np.uint8),
    })
    runs = bench_stamps.runs_of(block)
    np.testing.assert_array_equal(runs["n_runs"], [2, 1])
    np.testing.assert_array_equal(runs["run_length"], [1, 2, 2])
    np.testing.assert_array_equal(runs["segment"], [2, 1, 1])
