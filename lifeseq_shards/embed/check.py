"""``shardify embeddings verify`` (every person of the dataset's splits exactly once, whole and finite, every file
what its stamp says) and ``shardify embeddings merge`` (every file checked against its stamp first, then one file
ordered by person id, streamed). No torch here."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..progress import progress_bar
from ..store.manifest import Manifest, ManifestError
from ..store.remote import dataset_url, is_local, read_manifest
from ..store.shardfile import read_shard_blocks
from ..store.writes import discard, writing
from .stamp import content_problem, provenance_problem
from .store import (
    _TMP,
    ID_COLUMN,
    OUT_MANIFEST,
    EmbeddingsError,
    EmbeddingSpec,
    expected_shards,
    iter_rows,
    output_name,
    read_spec,
    shard_files,
)

__all__ = ["merge_embeddings", "verify_embeddings"]


def _open(out: Path) -> EmbeddingSpec:
    spec = read_spec(out)
    if spec is None:
        raise EmbeddingsError(f"{out}: no {OUT_MANIFEST} (not an embeddings directory, or no job has started on it)")
    return spec


def verify_embeddings(out: str | Path, data: str, progress: bool = True) -> list[str]:
    """Every problem found, one line each naming the output file; empty when every person of the splits the
    output was made for appears exactly once, with the manifest's fields, widths and dtype, and finite values."""
    out = Path(out)
    if not is_local(data):
        raise ManifestError(f"{data}: verify reads the input shards' person ids from the local disk")
    spec, manifest = _open(out), read_manifest(data)
    if manifest.fingerprint != spec.dataset:
        return [f"{out}: embeddings of dataset {spec.dataset}, but {data} is {manifest.fingerprint}"]
    missing_splits = [s for s in spec.splits if s not in manifest.splits]
    if missing_splits:
        return [f"{out}: embeddings of splits {list(spec.splits)}, but {data} has no {missing_splits}"]
    problems: list[str] = []
    listed = shard_files(out)
    expected = expected_shards(manifest, spec.splits)
    names = {output_name(e) for _, e in expected}
    for path in sorted(out.rglob("*.parquet")):
        rel = str(path.relative_to(out))
        if rel not in names and _TMP not in path.name:
            problems.append(f"{rel}: not the output of any input shard of {list(spec.splits)} (a copy? its persons "
                            "would be counted twice): remove it")
    for _, entry in progress_bar(expected, desc="verify embeddings", unit="shard", disable=not progress):
        rel = output_name(entry)
        if not (out / rel).is_file():
            problems.append(f"{rel}: missing ({entry.samples} persons of {entry.file} not embedded)")
            continue
        problems += _check_file(out / rel, rel, spec, _input_ids(data, manifest, entry.file), listed.get(rel, -1))
    return problems


def _input_ids(data: str, manifest: Manifest, file: str) -> np.ndarray:
    blocks = read_shard_blocks(dataset_url(data, file), manifest.schema)
    ids = [b.columns["person_id"].astype(np.int64) for b in blocks]
    return np.sort(np.concatenate(ids)) if ids else np.zeros(0, dtype=np.int64)


def _check_file(path: Path, rel: str, spec: EmbeddingSpec, want_ids: np.ndarray, listed: int) -> list[str]:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        return [f"{rel}: unreadable ({e})"]
    if table.schema != spec.schema():
        return [f"{rel}: columns {_describe(table.schema)}, {OUT_MANIFEST} says {_describe(spec.schema())}"]
    problem, stamp = provenance_problem(path, rel, spec, listed)
    if problem is None and stamp is not None:
        problem = content_problem(rel, table.to_batches(), spec, stamp)
    problems = [problem] if problem else []
    ids = table.column(ID_COLUMN).to_numpy()
    repeated = ids[1:][np.diff(ids) == 0]
    if len(repeated):
        problems.append(f"{rel}: person {int(repeated[0])} appears more than once ({len(repeated)} repeats)")
    if np.any(np.diff(ids) < 0):
        problems.append(f"{rel}: not sorted by {ID_COLUMN}")
    got = np.unique(ids)
    lost, foreign = np.setdiff1d(want_ids, got), np.setdiff1d(got, want_ids)
    if len(lost):
        problems.append(f"{rel}: {len(lost)} persons of its input shard missing (e.g. {int(lost[0])})")
    if len(foreign):
        problems.append(f"{rel}: {len(foreign)} persons not in its input shard (e.g. {int(foreign[0])})")
    for name, _ in spec.fields:
        values = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(values.astype(np.float32))
        if bad.any():
            width = table.schema.field(name).type.list_size
            person = int(ids[int(np.argmax(bad)) // width])
            problems.append(f"{rel}: {int(bad.sum())} NaN/inf values in {name} (first of person {person})")
    return problems


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def merge_embeddings(out: str | Path, target: str | Path, progress: bool = True) -> int:
    """Every finished shard file of ``out`` merged into ``target`` (one Parquet file, the same columns), ordered by
    person id; persons written returned. Every file is first checked against its stamp and ``_embeddings.json``
    (model, dataset, shard, person count, contents' digest): on a problem, :class:`EmbeddingsError` naming the
    file, and nothing is written. The shard files are each sorted, so this is a k-way merge that holds about one
    shard's rows at a time (a slice of each file). ``target`` appears only once complete. Refused unless every
    input shard's file is there (``shardify embeddings verify`` also checks them against the dataset's persons)."""
    out, target = Path(out), Path(target)
    spec = _open(out)
    files = shard_files(out)
    paths = [out / name for name in files]
    missing = [name for name in files if not (out / name).is_file()]
    if missing:
        raise EmbeddingsError(f"{out}: {len(missing)} shard files missing (first {missing[0]}): the job has not "
                              "finished; run it again (it resumes), then merge")
    per_file = max(256, max(files.values(), default=1) // max(1, len(paths)))
    _check_all(out, spec, files, per_file, progress)
    tmp = target.with_name(target.name + _TMP + uuid.uuid4().hex)
    total = 0
    try:
        with writing(target, "nothing merged"), \
                pq.ParquetWriter(tmp, spec.schema()) as writer, \
                progress_bar(total=sum(files.values()), desc="merge", unit="person", disable=not progress) as bar:
            last = None
            for table in _merged(paths, per_file):
                ids = table.column(ID_COLUMN).to_numpy()
                if len(ids) and (last is not None and ids[0] <= last or np.any(np.diff(ids) <= 0)):
                    raise EmbeddingsError(f"{out}: a person id appears twice across shard files: run "
                                          "`shardify embeddings verify`")
                writer.write_table(table)
                last = int(ids[-1]) if len(ids) else last
                total += len(ids)
                bar.update(len(ids))
            os.replace(tmp, target)
    finally:
        discard(tmp)
    return total


def _check_all(out: Path, spec: EmbeddingSpec, files: dict[str, int], batch_rows: int, progress: bool) -> None:
    """Each file's stamp against ``_embeddings.json``, then its rows against the stamp's digest (streamed);
    EmbeddingsError with the first problem, one line naming the file."""
    problems = []
    for rel, listed in progress_bar(files.items(), desc="check", unit="file", disable=not progress):
        problem, stamp = provenance_problem(out / rel, rel, spec, listed)
        if problem is None and stamp is not None:
            try:
                problem = content_problem(rel, iter_rows(out / rel, batch_rows), spec, stamp)
            except (OSError, pa.ArrowException) as e:
                problem = f"{rel}: unreadable ({e})"
        if problem:
            problems.append(problem)
    if problems:
        more = f" (and {len(problems) - 1} more file(s); `shardify embeddings verify` lists them)" \
            if len(problems) > 1 else ""
        raise EmbeddingsError(f"{out}/{problems[0]}; nothing merged{more}")


def _merged(paths: list[Path], per_file: int) -> Iterator[pa.Table]:
    """Tables in person-id order: each round takes, from every file's buffered slice, the rows up to the smallest
    of the slices' last ids (nothing later in any file can come before it), so every round empties one slice."""
    streams = [iter_rows(p, per_file) for p in paths]
    buffers: list[pa.Table | None] = [None] * len(paths)

    def refill(i: int) -> None:
        while buffers[i] is None or buffers[i].num_rows == 0:
            batch = next(streams[i], None)
            if batch is None:
                buffers[i] = None
                return
            buffers[i] = pa.Table.from_batches([batch])

    for i in range(len(paths)):
        refill(i)
    while any(b is not None for b in buffers):
        live = [i for i, b in enumerate(buffers) if b is not None]
        bound = min(int(buffers[i].column(ID_COLUMN)[-1].as_py()) for i in live)
        parts = []
        for i in live:
            ids = buffers[i].column(ID_COLUMN).to_numpy()
            cut = int(np.searchsorted(ids, bound, side="right"))
            parts.append(buffers[i].slice(0, cut))
            buffers[i] = buffers[i].slice(cut)
            if buffers[i].num_rows == 0:
                refill(i)
        table = pa.concat_tables(parts)
        yield table.take(pa.array(np.argsort(table.column(ID_COLUMN).to_numpy(), kind="stable")))
