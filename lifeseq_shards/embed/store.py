"""An embedding output directory on disk: its manifest, one Parquet file per input shard, written atomically.

``OUT/_embeddings.json`` says what the directory holds (the dataset's fingerprint and splits, the model, the
fields with their widths, the dtype); ``OUT/<split>/<shard>.parquet`` holds the persons of one input shard, sorted
by person id: a column ``person_id`` (int64) and one ``fixed_size_list<dtype>[width]`` column per field, stamped
with where it comes from and a digest of its rows (:mod:`lifeseq_shards.embed.stamp`). A shard's file is written
under a temporary name and renamed once all of its persons are in it, so a file under its final name is a
finished shard, and a job started again skips it. No torch here: ``shardify embeddings`` uses it.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..store.manifest import Manifest, ShardEntry
from ..store.writes import discard, writing
from .spec import ID_COLUMN, EmbeddingsError, EmbeddingSpec
from .stamp import OUT_MANIFEST, output_of, provenance_problem, stamp_table

DTYPES = ("float16", "float32")
FLOAT16_PYARROW = 15  # the first pyarrow that writes Parquet's float16
_TMP = ".tmp-"  # in the name of a file being written (which also starts with "."): never a finished shard


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise EmbeddingsError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if dtype == "float16" and int(pa.__version__.split(".")[0]) < FLOAT16_PYARROW:
        raise EmbeddingsError(f"dtype 'float16': Parquet float16 needs pyarrow >= {FLOAT16_PYARROW} (this is "
                              f"{pa.__version__}): upgrade pyarrow, or use dtype='float32'")


def check_fields(fields: Mapping[str, int]) -> None:
    if not fields or ID_COLUMN in fields or any(not isinstance(w, int) or w < 1 for w in fields.values()):
        raise EmbeddingsError(f"fields {dict(fields)!r}: give each embedding a name (not {ID_COLUMN!r}) and a width "
                              ">= 1, e.g. {'cls': 512, 'mean': 512}")


def expected_shards(manifest: Manifest, splits: Sequence[str]) -> list[tuple[int, ShardEntry]]:
    """(position among the manifest's shards, entry) of every input shard of ``splits``, remainders included."""
    chosen = set(splits)
    return [(i, e) for i, (name, e) in enumerate(manifest.entries()) if name in chosen]


def output_name(entry: ShardEntry) -> str:
    """The output file of an input shard: its path with ``.parquet`` for ``.tar``."""
    return output_of(entry.file)


def _read_json(out: Path) -> dict | None:
    path = out / OUT_MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EmbeddingsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise EmbeddingsError(f"{path}: not an embeddings manifest")
    return data


def read_spec(out: Path) -> EmbeddingSpec | None:
    data = _read_json(out)
    return None if data is None else EmbeddingSpec.from_json(data, str(out / OUT_MANIFEST))


def shard_files(out: Path) -> dict[str, int]:
    """Output file -> persons, for every input shard the directory is meant to hold (recorded when it was made)."""
    data = _read_json(out)
    if data is None or not isinstance(data.get("shards"), dict):
        raise EmbeddingsError(f"{out / OUT_MANIFEST}: missing, or lists no shards")
    return {str(k): int(v) for k, v in data["shards"].items()}


def _differences(old: EmbeddingSpec, new: EmbeddingSpec) -> list[str]:
    names = {"dataset": "dataset fingerprint", "splits": "splits", "model": "model", "fields": "fields",
             "dtype": "dtype", "padding": "padding"}
    return [f"{names[k]} {getattr(old, k)!r}, not {getattr(new, k)!r}" for k in names
            if getattr(old, k) != getattr(new, k)]


def open_output(out: Path, spec: EmbeddingSpec, manifest: Manifest) -> list[str]:
    """Make ``out`` hold ``spec``'s embeddings (a new directory, or one this spec wrote before) and return the input
    shards (manifest paths) whose output is finished. Leftover temporary files of a killed job are removed: call it
    before any rank writes. Another spec's directory is refused, naming what differs, and so is a finished file
    that is not what its stamp and ``_embeddings.json`` say (from the footer: another model's, another shard's,
    rows missing, cut short, or without a stamp); :func:`lifeseq_shards.embed.check.verify_embeddings` also checks
    its contents against the stamp's digest."""
    with writing(out, "no shard was embedded"):
        out.mkdir(parents=True, exist_ok=True)
        old = read_spec(out)
        if old is not None and old != spec:
            raise EmbeddingsError(f"{out}: holds other embeddings ({'; '.join(_differences(old, spec))}): write "
                                  "them to another directory, or delete this one")
        if old is None:
            if any(p.suffix == ".parquet" for p in out.rglob("*")):
                raise EmbeddingsError(f"{out}: holds .parquet files but no {OUT_MANIFEST}: not an embeddings "
                                      "directory this package wrote; use an empty or new directory")
            tmp = out / ("." + OUT_MANIFEST + _TMP + uuid.uuid4().hex)
            files = {output_name(e): e.samples for _, e in expected_shards(manifest, spec.splits)}
            try:
                tmp.write_text(json.dumps({**spec.to_json(), "shards": files}, indent=1))
                os.replace(tmp, out / OUT_MANIFEST)
            finally:
                discard(tmp)
        for stale in out.rglob(f"*{_TMP}*"):
            stale.unlink()
    done = []
    for _, entry in expected_shards(manifest, spec.splits):
        rel = output_name(entry)
        if not (out / rel).exists():
            continue
        problem, _ = provenance_problem(out / rel, rel, spec, entry.samples)
        if problem:
            raise EmbeddingsError(f"{out}/{problem}")
        done.append(entry.file)
    return done


def write_shard(out: Path, entry: ShardEntry, spec: EmbeddingSpec, ids: np.ndarray,
                arrays: Mapping[str, np.ndarray]) -> Path:
    """One input shard's embeddings, sorted by person id and stamped (:mod:`lifeseq_shards.embed.stamp`), written
    under a temporary name, flushed to disk and renamed: a file under the final name is whole. A failed write
    (a full disk) raises :class:`~lifeseq_shards.store.writes.WriteFailed` naming the file, and leaves none."""
    order = np.argsort(ids, kind="stable")
    columns = [pa.array(ids[order].astype(np.int64))]
    for name, width in spec.fields:
        flat = np.ascontiguousarray(arrays[name][order], dtype=spec.dtype).reshape(-1)
        columns.append(pa.FixedSizeListArray.from_arrays(pa.array(flat), width))
    table = stamp_table(pa.Table.from_arrays(columns, schema=spec.schema()), spec, entry.file)
    final = out / output_name(entry)
    tmp = final.with_name("." + final.name + _TMP + uuid.uuid4().hex)
    try:
        with writing(final, f"its {len(ids)} persons are not kept"):
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                pq.write_table(table, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
    finally:  # a full disk or any failure: no temporary file left behind, and no final file
        discard(tmp)
    return final


def iter_rows(path: Path, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """A finished shard file in record batches of at most ``batch_rows`` rows."""
    yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
