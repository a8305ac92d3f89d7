"""Embedding files carry their provenance (issue 33): a file of another model copied in, vectors moved between the
persons of a file, a person deleted, a file cut short, one moved to another shard's name or written without a stamp
are each named, in one line, by `shardify embeddings verify`, by `merge` (which then writes nothing, exit 2) and,
where the footer tells, by a job that resumes into the directory."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from embed_helpers import broken_copy, embed_in_process, model_for, verify
from helpers import shardify

from lifeseq_shards import EmbeddingWriter
from lifeseq_shards.embed.store import EmbeddingsError
from lifeseq_shards.reader import World
from lifeseq_shards.store.remote import read_manifest

VICTIM = "train/shard-000002.parquet"


@pytest.fixture(scope="module")
def other(ds: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same dataset, fields and dtype embedded by another model (one weight changed)."""
    model = model_for(ds)
    with torch.no_grad():
        model.encoder.norm.weight.add_(1.0)
    out = tmp_path_factory.mktemp("other") / "emb"
    embed_in_process(ds, out, model=model)
    return out


def rewrite(path: Path, edit: Callable[[pa.Table], pa.Table]) -> None:
    """The file written again by hand with pyarrow, its key-value metadata (the stamp) carried over as read."""
    table = pq.read_table(path)
    pq.write_table(edit(table).replace_schema_metadata(table.schema.metadata), path)


def swap_two_persons(table: pa.Table) -> pa.Table:
    """The vectors of the file's first two persons exchanged, ids kept in place."""
    order = np.arange(table.num_rows)
    order[[0, 1]] = [1, 0]
    cols = [table.column("person_id")] + [table.column(n).take(pa.array(order)) for n in ("cls", "mean")]
    return pa.Table.from_arrays(cols, schema=table.schema)


def merge(out: Path) -> tuple[int, str, Path]:
    target = out.parent / "merged.parquet"
    code, text = shardify("embeddings", "merge", out, target)
    return code, text, target


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def resume(out: Path, ds: Path) -> list[str]:
    return EmbeddingWriter(out).open(ds, model=model_for(ds), world=World(0, 1))


def test_a_file_of_another_model_is_named_by_verify_merge_and_a_resuming_job(ds: Path, done: Path, other: Path,
                                                                               tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    shutil.copy(other / VICTIM, out / VICTIM)  # a hole filled by hand from another run
    assert (out / VICTIM).read_bytes() != (done / VICTIM).read_bytes()
    code, text = verify(out, ds)
    assert code == 1 and f"{VICTIM}: embeddings of model" in text, text
    code, text, target = merge(out)
    assert code == 2 and len(error_lines(text)) == 1 and VICTIM in error_lines(text)[0], text
    assert "model" in error_lines(text)[0] and not target.exists()
    assert not list(tmp_path.glob("merged*"))  # no temporary file either
    with pytest.raises(EmbeddingsError, match=f"{VICTIM}: embeddings of model"):
        resume(out, ds)


@pytest.mark.parametrize("edit", ["swap", "delete"])
def test_vectors_moved_between_persons_or_a_person_deleted_are_named(ds: Path, done: Path, tmp_path: Path,
                                                                      edit: str) -> None:
    out = broken_copy(done, tmp_path)
    rewrite(out / VICTIM, swap_two_persons if edit == "swap" else lambda t: t.slice(1))
    said = "contents differ from its stamp" if edit == "swap" else "123 persons, its stamp says 124"
    code, text = verify(out, ds)
    assert code == 1 and f"{VICTIM}: {said}" in text, text
    code, text, target = merge(out)
    assert code == 2 and len(error_lines(text)) == 1 and f"{VICTIM}: {said}" in error_lines(text)[0], text
    assert not target.exists() and not list(tmp_path.glob("merged*"))
    if edit == "delete":  # the footer's row count tells; the swap needs every row read (verify and merge do)
        with pytest.raises(EmbeddingsError, match=f"{VICTIM}: {said}"):
            resume(out, ds)


def test_a_truncated_file_is_named_by_merge_in_one_line_and_by_a_resuming_job(ds: Path, done: Path,
                                                                              tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    data = (out / VICTIM).read_bytes()
    (out / VICTIM).write_bytes(data[: len(data) // 2])
    code, text, target = merge(out)
    assert code == 2 and len(error_lines(text)) == 1 and f"{VICTIM}: unreadable" in error_lines(text)[0], text
    assert not target.exists()
    with pytest.raises(EmbeddingsError, match=f"{VICTIM}: unreadable"):
        resume(out, ds)


def test_a_file_under_another_shards_name_is_named(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    shutil.copy(out / "train" / "shard-000001.parquet", out / VICTIM)  # same size: 124 persons each
    code, text, _ = merge(out)
    assert code == 2 and f"{VICTIM}: the embeddings of input shard train/shard-000001.tar" in text, text
    with pytest.raises(EmbeddingsError, match="the embeddings of input shard train/shard-000001.tar"):
        resume(out, ds)


def test_a_file_without_a_stamp_is_refused_with_how_to_embed_it_again(ds: Path, done: Path, tmp_path: Path) -> None:
    """As written before stamps existed: the same rows, no key-value metadata."""
    out = broken_copy(done, tmp_path)
    table = pq.read_table(out / VICTIM)
    pq.write_table(table.replace_schema_metadata(None), out / VICTIM)
    code, text = verify(out, ds)
    assert code == 1 and f"{VICTIM}: no provenance stamp" in text and "delete it and run the embedding job" in text
    code, text, target = merge(out)
    assert code == 2 and f"{VICTIM}: no provenance stamp" in text and not target.exists(), text
    with pytest.raises(EmbeddingsError, match=f"{VICTIM}: no provenance stamp"):
        resume(out, ds)
    (out / VICTIM).unlink()  # what the message says to do: the job embeds that shard again
    assert len(resume(out, ds)) == 10


def test_a_sound_output_still_verifies_merges_and_resumes(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    assert verify(out, ds)[0] == 0
    code, text, target = merge(out)
    assert code == 0 and pq.read_metadata(target).num_rows == sum(e.samples for _, e in read_manifest(ds).entries())
    assert len(resume(out, ds)) == 11
