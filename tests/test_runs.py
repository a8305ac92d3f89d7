"""Format 2 stores abspos / age / segment once per run of tokens that share them: a run never crosses a person,
any stamp change starts one, and expanding the runs gives the per-token stamps of the input exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import SeedRows

from lifeseq_shards.store.format import (
    STAMPS,
    Block,
    decode_member,
    expand_runs,
    make_schema,
    to_runs,
)
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import iter_tar_members


def test_stored_runs_expand_to_the_seed_stamps(nomlm_dataset: Path, nomlm_rows: SeedRows) -> None:
    """Straight from the shard bytes: every person's runs add up to its length and repeat to the seed's rows."""
    m = read_manifest(nomlm_dataset)
    schema = m.schema
    row_of, stamps = nomlm_rows.row, nomlm_rows.cols["input_ids"][:, 1:]
    runs_total = tokens_total = 0
    for entry in m.splits["train"].shards[:6]:
        with open(nomlm_dataset / entry.file, "rb") as fh:
            for _, data in iter_tar_members(fh):
                block = decode_member(data, schema)
                c = block.columns
                assert c["n_runs"].sum() == len(c["run_length"])
                ends = np.concatenate([[0], np.cumsum(c["run_length"], dtype=np.int64)])
                runs = block.offsets("n_runs")
                np.testing.assert_array_equal(ends[runs[1:]] - ends[runs[:-1]], c["length"])
                tokens = expand_runs(block, schema)
                offs = tokens.offsets()
                for i, pid in enumerate(c["person_id"].tolist()):
                    for k, name in enumerate(STAMPS):
                        np.testing.assert_array_equal(tokens.columns[name][offs[i] : offs[i + 1]],
                                                      stamps[row_of[pid], k, : c["length"][i]])
                runs_total += len(c["run_length"])
                tokens_total += int(offs[-1])
    assert tokens_total / runs_total > 3  # the sample's events hold several tokens: there are runs to merge


def test_a_run_ends_at_a_person_and_at_any_stamp_change() -> None:
    """Two persons with the same stamps stay two runs; a change of segment alone starts a run."""
    block = Block({
        "person_id": np.array([7, 8], dtype=np.int64),
        "length": np.array([3, 2], dtype=np.uint16),
        "tokens": np.array([5, 6, 7, 8, 9], dtype=np.uint16),
        "abspos": np.array([10, 10, 10, 10, 10], dtype=np.int16),
        "age": np.array([30, 30, 30, 30, 30], dtype=np.uint8),
        "segment": np.array([2, 1, 1, 1, 1], dtype=np.uint8),
    })
    schema = make_schema("uint16")
    runs = to_runs(block, schema).columns
    np.testing.assert_array_equal(runs["n_runs"], [2, 1])
    np.testing.assert_array_equal(runs["run_length"], [1, 2, 2])
    np.testing.assert_array_equal(runs["segment"], [2, 1, 1])
    back = expand_runs(to_runs(block, schema), schema).columns
    assert back.keys() == block.columns.keys()
    for name, col in block.columns.items():
        np.testing.assert_array_equal(back[name], col)
        assert back[name].dtype == col.dtype
