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
                pool: ProcessPoolExecutor | None, progress: bool, select: list[np.ndarray] | None = None) -> Tally:
    """Pass 1: every task of ``source`` encoded and narrowed to ``schema`` (in ``pool``, at most 2 x ``processes``
    tasks pending), each person spilled to its bucket (of ``buckets``, by ``seed``). With ``select`` (per task, the
    sorted ids of the persons to encode: an array task's share) only those persons are encoded and spilled. Returns
    the tally of what was encoded."""
    jobs = ((source, t, schema, None if select is None else select[i]) for i, t in enumerate(source.tasks))
    tally = Tally()
    for path, row, every_id, why, block in _each(pool, processes, _encode_and_narrow, jobs, len(source.tasks),
                                                 progress, "encode"):
        tally.add(path, row, every_id, why, block)
        if block.n == 0:
            continue
        bucket = bucket_of(block.columns["person_id"], seed, buckets)
        by_bucket = block.take(np.argsort(bucket, kind="stable"), schema)
        bounds = np.cumsum(np.bincount(bucket, minlength=buckets))
        for b in np.nonzero(np.diff(bounds, prepend=0))[0]:
            spill.add(int(b), by_bucket.slice(int(bounds[b - 1]) if b else 0, int(bounds[b]), schema))
    spill.close()
    return tally


def survey_pass(source: Source, processes: int, pool: ProcessPoolExecutor | None, progress: bool) -> Tally:
    """Every task's persons (ids, lengths, drops) without encoding them (``source.survey``): what an array task must
    know of everyone before it encodes only its share."""
    tally = Tally()
    for result in _each(pool, processes, _survey, ((source, t) for t in source.tasks), len(source.tasks), progress,
                        "survey"):
        tally.add(*result)
    return tally


class Tally:
    """What a pass met, task by task: every input row's id (filtered out or kept: a duplicate is one either way) with
    its file and rows, the rows dropped by reason, and the kept persons' ids and lengths."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []  # the persons kept, by task (given up by found())
        self.counts: list[int] = []  # how many persons each task kept
        self.seen: list[np.ndarray] = []
        self.rows: list[tuple[str, np.ndarray]] = []
        self.hist = np.zeros(1, dtype=np.int64)
        self.tokens = 0
        self.dropped: Counter[str] = Counter()

    @property
    def persons(self) -> int:
        return sum(self.counts)

    def add(self, path: str, row: np.ndarray, every_id: np.ndarray, why: dict[str, int], block: Block) -> None:
        self.seen.append(every_id)
        self.rows.append((path, row))
        self.dropped.update(why)
        self.ids.append(block.columns["person_id"].astype(np.int64))
        self.counts.append(block.n)
        if block.n == 0:
            return
        lengths = block.columns["length"].astype(np.int64)
        self.tokens += int(lengths.sum())
        hb = lengths // HISTOGRAM_BIN
        if hb.max() >= len(self.hist):
            self.hist = np.concatenate([self.hist, np.zeros(int(hb.max()) + 1 - len(self.hist), dtype=np.int64)])
        np.add.at(self.hist, hb, 1)

    def found(self, source: Source) -> tuple[np.ndarray, np.ndarray, int, dict[str, int], str]:
        """(the kept persons' ids, their length histogram by :data:`HISTOGRAM_BIN`, their tokens, the input rows
        dropped by reason, the sha256 of every input row's person id); a person id that occurs twice, or no person
        left, is a ConvertError. The per-task id and row arrays are let go once used (the pass's only per-person
        arrays: a conversion holds them no longer than this; ``counts`` stays)."""
        all_ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        self.ids = []
        if len(all_ids) == 0:
            raise ConvertError(f"{source.tasks[0][0] if source.tasks else '?'}: no person left to convert "
                               "(empty input, or every person filtered out)")
        # every input row's id, sorted in place: without duplicates it is np.unique's result, with none of its
        # copies (a sorted copy, an index and the counts, each 8 bytes a person)
        seen = np.concatenate(self.seen)
        seen.sort()
        twice = seen[1:] == seen[:-1]
        if twice.any():
            pid = seen[1:][twice][0]
            at = [f"{path}: row {r}" for chunk, (path, row) in zip(self.seen, self.rows, strict=True)
                  for r in row[chunk == pid]]
            raise ConvertError(f"{at[0]}: person id {pid} occurs {len(at)} times (also {', '.join(at[1:])})")
        del twice
        self.seen, self.rows = [], []
        # the digest of the ids' little-endian int64 bytes, read in place (no copy of them)
        digest = hashlib.sha256(memoryview(np.ascontiguousarray(seen, dtype="<i8"))).hexdigest()
        return all_ids, self.hist, self.tokens, dict(self.dropped), digest


def bucket_of(pid: np.ndarray, seed: int, buckets: int) -> np.ndarray:
    """Each person's spill bucket: a seeded hash of the id, so a bucket's persons are known from the ids alone."""
    h = mix64(pid, seed * 2 + 1)
    np.remainder(h, np.uint64(buckets), out=h)
    return h.view(np.int64)  # < buckets: the same values as int64, without a copy


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


def _each(pool: ProcessPoolExecutor | None, processes: int, fn: Any, jobs: Iterator[Any], total: int,
          progress: bool, desc: str) -> Iterator[Any]:
    """``fn`` of each job, in order (in ``pool`` when there is one), with a progress bar of the ``total`` jobs."""
    results = _ordered_map(pool, fn, jobs, 2 * processes) if pool else map(fn, jobs)
    with progress_bar(total=total, desc=desc, unit="task", disable=not progress) as bar:
        for result in results:
            bar.update(1)
            yield result


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


def _encode_and_narrow(args: tuple[Source, Any, list[Field], np.ndarray | None]) -> tuple[
        str, np.ndarray, np.ndarray, dict[str, int], Block]:
    """(file, the task's input rows, their person ids (filtered out ones included: for the duplicate check), the
    rows dropped by reason, the narrowed block of the persons kept (those selected, with a selection))."""
    source, task, schema, select = args
    path, rows, every_id, why, block = _unpack(task, source.encode(task) if select is None else
                                               source.encode(task, select=select))
    return path, rows, every_id, why, to_runs(_narrow(block, token_schema(schema), _task_label(task)), schema)


def _survey(args: tuple[Source, Any]) -> tuple[str, np.ndarray, np.ndarray, dict[str, int], Block]:
    """As :func:`_encode_and_narrow`, the block without tokens (``source.survey``: ids and lengths)."""
    source, task = args
    assert source.survey is not None
    return _unpack(task, source.survey(task))


def _unpack(task: Any, block: Block) -> tuple[str, np.ndarray, np.ndarray, dict[str, int], Block]:
    """A source block's rows, every id and drop reasons taken out of it, beside it."""
    rows = block.columns.pop("row")
    every_id = block.columns.pop("every_id", block.columns["person_id"])
    why = drops.counts(block.columns.pop(drops.DROP_REASON, np.zeros(len(rows), dtype=np.int64)))
    return task[0], rows, every_id.astype(np.int64), why, block


def mix64(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of (x + salt): a seeded hash of person ids, the same on every machine."""
    with np.errstate(over="ignore"):  # in place: one copy of x and one temporary, each 8 bytes an id
        z = x.astype(np.uint64)
        z += np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return z
