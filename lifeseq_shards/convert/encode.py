"""Pass 1 of a conversion (:mod:`.passes`): the input's tasks (row groups / row ranges) encoded, in a process pool
when there is one; each person narrowed to the schema's dtypes (a value that does not fit is an error naming file and
person), given a bucket by a seeded hash of its id (:func:`bucket_of`, :func:`mix64`), and spilled to that temp
bucket file. The persons' ids, lengths and the input rows dropped are counted on the way, for pass 2 and the
manifest."""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np

from ..progress import progress_bar
from ..store.format import Block, Field, check_fits, to_runs, token_schema
from .outdir import ConvertError
from .sources import Source, drops
from .writers import Spill

HISTOGRAM_BIN = 8  # tokens per bin of the manifest's length histogram



def encode_pass(source: Source, schema: list[Field], spill: Spill, buckets: int, seed: int, processes: int,
                pool: ProcessPoolExecutor | None, progress: bool) -> tuple[np.ndarray, np.ndarray, int, dict[str, int],
                                                                           str]:
    """Pass 1: every task of ``source`` encoded and narrowed to ``schema`` (in ``pool``, at most 2 x ``processes``
    tasks pending), each person spilled to its bucket (of ``buckets``, by ``seed``). Returns (the kept persons' ids,
    their length histogram by :data:`HISTOGRAM_BIN`, their tokens, the input rows dropped by reason, the sha256 of
    every input row's person id); a person id that occurs twice, or no person left, is a ConvertError."""
    jobs = ((source, t, schema) for t in source.tasks)
    results = _ordered_map(pool, _encode_and_narrow, jobs, 2 * processes) if pool else map(
        _encode_and_narrow, jobs)
    ids: list[np.ndarray] = []  # the persons kept
    # every input row's person id, filtered out or kept (a duplicate is one either way), with its file and rows
    seen: list[np.ndarray] = []
    rows: list[tuple[str, np.ndarray]] = []
    hist = np.zeros(1, dtype=np.int64)
    tokens = 0
    dropped: Counter[str] = Counter()
    with progress_bar(total=len(source.tasks), desc="encode", unit="task", disable=not progress) as bar:
        for path, row, every_id, why, block in results:
            bar.update(1)
            seen.append(every_id)
            rows.append((path, row))
            dropped.update(why)
            if block.n == 0:
                continue
            pid = block.columns["person_id"]
            bucket = bucket_of(pid, seed, buckets)
            by_bucket = block.take(np.argsort(bucket, kind="stable"), schema)
            bounds = np.cumsum(np.bincount(bucket, minlength=buckets))
            for b in np.nonzero(np.diff(bounds, prepend=0))[0]:
                spill.add(int(b), by_bucket.slice(int(bounds[b - 1]) if b else 0, int(bounds[b]), schema))
            ids.append(pid.astype(np.int64))
            lengths = block.columns["length"].astype(np.int64)
            tokens += int(lengths.sum())
            hb = lengths // HISTOGRAM_BIN
            if hb.max() >= len(hist):
                hist = np.concatenate([hist, np.zeros(int(hb.max()) + 1 - len(hist), dtype=np.int64)])
            np.add.at(hist, hb, 1)
    spill.close()
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if len(all_ids) == 0:
        raise ConvertError(f"{source.tasks[0][0] if source.tasks else '?'}: no person left to convert "
                           "(empty input, or every person filtered out)")
    uniq, counts = np.unique(np.concatenate(seen), return_counts=True)
    if (counts > 1).any():
        pid = uniq[counts > 1][0]
        at = [f"{path}: row {r}" for chunk, (path, row) in zip(seen, rows, strict=True) for r in row[chunk == pid]]
        raise ConvertError(f"{at[0]}: person id {pid} occurs {len(at)} times (also {', '.join(at[1:])})")
    return all_ids, hist, tokens, dict(dropped), hashlib.sha256(uniq.astype("<i8").tobytes()).hexdigest()


def bucket_of(pid: np.ndarray, seed: int, buckets: int) -> np.ndarray:
    """Each person's spill bucket: a seeded hash of the id, so a bucket's persons are known from the ids alone."""
    return (mix64(pid, seed * 2 + 1) % np.uint64(buckets)).astype(np.int64)


def _ordered_map(pool: ProcessPoolExecutor, fn: Any, items: Iterator[Any], inflight: int) -> Iterator[Any]:
    """``pool.map`` that keeps at most ``inflight`` results pending (Executor.map submits everything at once, and
    finished blocks waiting for a slow consumer would hold the whole input in memory)."""
    window: deque[Future[Any]] = deque()
    for item in items:
        window.append(pool.submit(fn, item))
        if len(window) >= inflight:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


def _narrow(block: Block, schema: list[Field], where: str) -> Block:
    cols = {}
    for f in schema:
        col = block.columns[f.name]
        try:
            check_fits(f.name, col, f.dtype, where)
        except ValueError as e:
            bad = _offending_person(block, f, schema)
            raise ConvertError(f"{e} (person {bad})") from None
        cols[f.name] = col.astype(f.dtype)
    return Block(cols)


def _offending_person(block: Block, f: Field, schema: list[Field]) -> int:
    info = np.iinfo(f.dtype)
    for i in range(block.n):
        one = block.take(np.array([i]), schema).columns[f.name]
        if one.size and (one.min() < info.min or one.max() > info.max):
            return int(block.columns["person_id"][i])
    return -1


def _task_label(task: Any) -> str:
    if isinstance(task, tuple) and len(task) == 3:
        return f"{task[0]} rows {task[1]}-{task[2]}"
    if isinstance(task, tuple) and len(task) == 2:
        return f"{task[0]} row group {task[1]}"
    return str(task)


def _encode_and_narrow(args: tuple[Source, Any, list[Field]]) -> tuple[str, np.ndarray, np.ndarray, dict[str, int],
                                                                        Block]:
    """(file, the task's input rows, their person ids (filtered out ones included: for the duplicate check), the
    rows dropped by reason, the narrowed block of the persons kept)."""
    source, task, schema = args
    block = source.encode(task)
    rows = block.columns.pop("row")
    every_id = block.columns.pop("every_id", block.columns["person_id"])
    why = drops.counts(block.columns.pop(drops.DROP_REASON, np.zeros(len(rows), dtype=np.int64)))
    return task[0], rows, every_id.astype(np.int64), why, to_runs(_narrow(block, token_schema(schema),
                                                                          _task_label(task)), schema)


def mix64(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of (x + salt): a seeded hash of person ids, the same on every machine."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
