"""Input files -> equal-sized, shuffled, checksummed shards + manifest.

Two passes, memory bounded by a bucket, not by the input:
1. tasks (row groups / row ranges) are encoded in a process pool; each person is narrowed to the schema's dtypes
   (a value that does not fit is an error naming file and person), given a split hash and a bucket hash, and
   spilled to a temp bucket file;
2. once the totals are known (shard count, persons per shard, val threshold), the buckets are read one at a time,
   shuffled, and cut into shards of exactly ``n`` persons; the persons that do not fill the last round go to a
   ``remainder`` shard that training skips and inference reads. The manifest is written last.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
import struct
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import zstandard
from tqdm import tqdm

from .format import (
    FORMAT_VERSION,
    MANIFEST,
    MIN_SHARD_PERSONS,
    Block,
    Field,
    check_fits,
    concat_blocks,
    decode_block,
    encode_block,
    fingerprint,
    make_schema,
    narrowest_token_dtype,
    shard_entries,
    to_runs,
    token_schema,
    write_manifest,
    write_shard,
)
from .sources import Source, SourceError, open_sources

# Shard counts with many divisors, so that most nodes x GPUs x workers products divide them.
HIGHLY_COMPOSITE = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040]
BUCKET_PERSONS = 100_000
# ours in a dataset directory: the lock held while a conversion runs; the directory a new dataset is built in; the
# mark present while old files are replaced by new ones (it holds the old manifest, so a rerun knows what to clear)
LOCK, STAGING, INCOMPLETE = ".conversion.lock", ".conversion-staging", ".conversion-incomplete"
OURS = (LOCK, STAGING, INCOMPLETE)


# what --dtype may set (a count field such as `length` sets every count and position in a sequence with it)
DTYPE_FIELDS = ("tokens", "length", "abspos", "age", "segment")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


class ConvertError(ValueError):
    """Bad input or a refused output directory; the message is one line."""


def check_dtypes(dtypes: dict[str, str]) -> None:
    """Refuse an override that would be ignored (an unknown field, a typo) or could not hold the values exactly."""
    for name, dtype in dtypes.items():
        if name not in DTYPE_FIELDS:
            raise ConvertError(f"--dtype {name}={dtype}: no field {name!r} to set (fields: {', '.join(DTYPE_FIELDS)})")
        if dtype not in INT_DTYPES:
            raise ConvertError(f"--dtype {name}={dtype}: not an integer dtype (one of {', '.join(INT_DTYPES)})")


@dataclass
class ConvertOptions:
    val_fraction: float = 0.05
    num_val: int | None = None
    nodes: int | None = None
    gpus: int | None = None
    workers: int | None = None
    shards: int | None = None
    min_shard_persons: int = MIN_SHARD_PERSONS
    processes: int = 1
    seed: int = 0
    max_seq_len: int = 512
    time_range_start: int | None = None
    time_range_end: int | None = 16438
    block_persons: int = 256
    zstd_level: int = 9
    with_all: bool = False
    overwrite: bool = False
    dtypes: dict[str, str] = field(default_factory=dict)
    progress: bool = True


def shard_count(persons: int, opts: ConvertOptions) -> int:
    """Shards for a split of ``persons``: exactly --shards, else a multiple of nodes x gpus x workers, else the
    largest highly composite number that keeps >= min_shard_persons per shard (so < 1 % fall in the remainder)."""
    if persons == 0:
        return 0
    if opts.shards:
        if opts.shards > persons:
            raise ConvertError(f"--shards {opts.shards} is more than the {persons} persons of a split")
        return opts.shards
    default = max([h for h in HIGHLY_COMPOSITE if h * opts.min_shard_persons <= persons] or [1])
    slots = (opts.nodes or 1) * (opts.gpus or 1) * (opts.workers or 1)
    if slots == 1:
        return default
    if slots > persons:
        raise ConvertError(f"{slots} readers (nodes x gpus x workers) is more than the {persons} persons of a split")
    return slots * max(1, default // slots)


def mix64(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of (x + salt): a seeded hash of person ids, the same on every machine."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# ---------------------------------------------------------------------------------------------------------------
# pass 1


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


def _encode_and_narrow(args: tuple[Source, Any, list[Field]]) -> tuple[str, np.ndarray, Block]:
    """(file, each person's row in it, the narrowed block)."""
    source, task, schema = args
    block = source.encode(task)
    rows = block.columns.pop("row")
    return task[0], rows, to_runs(_narrow(block, token_schema(schema), _task_label(task)), schema)


class _Spill:
    """Append-only temp files, one per bucket, of length-prefixed zstd blocks."""

    def __init__(self, root: Path, buckets: int, schema: list[Field]):
        self.paths = [root / f"bucket-{b:05d}.bin" for b in range(buckets)]
        self.files = [open(p, "wb") for p in self.paths]
        self.schema = schema
        self.cctx = zstandard.ZstdCompressor(level=1)

    def add(self, bucket: int, block: Block) -> None:
        data = self.cctx.compress(encode_block(block, self.schema))
        self.files[bucket].write(struct.pack("<Q", len(data)) + data)

    def close(self) -> None:
        for fh in self.files:
            fh.close()

    def read(self, bucket: int) -> list[Block]:
        dctx = zstandard.ZstdDecompressor()
        out, raw = [], self.paths[bucket].read_bytes()
        pos = 0
        while pos < len(raw):
            (size,) = struct.unpack_from("<Q", raw, pos)
            out.append(decode_block(dctx.decompress(raw[pos + 8 : pos + 8 + size]), self.schema))
            pos += 8 + size
        return out


# ---------------------------------------------------------------------------------------------------------------
# pass 2


@dataclass
class _SplitWriter:
    """Cuts a split's person stream into shards of exactly ``per_shard`` persons; the tail is the remainder."""

    name: str
    out: Path
    shards: int
    per_shard: int
    opts: ConvertOptions
    schema: list[Field]
    pool: ProcessPoolExecutor | None
    pending: list[Block] = field(default_factory=list)
    pending_n: int = 0
    written: int = 0
    futures: list[tuple[str, Future[dict[str, Any]] | dict[str, Any]]] = field(default_factory=list)

    def add(self, block: Block) -> None:
        self.pending.append(block)
        self.pending_n += block.n
        if self.written >= self.shards or self.pending_n < self.per_shard:
            return
        merged, start = concat_blocks(self.pending, self.schema), 0
        while self.written < self.shards and merged.n - start >= self.per_shard:
            self._submit(f"shard-{self.written:06d}.tar", merged.slice(start, start + self.per_shard, self.schema))
            start += self.per_shard
            self.written += 1
        rest = merged.slice(start, merged.n, self.schema)
        self.pending, self.pending_n = [rest], rest.n

    def finish(self) -> None:
        if self.written != self.shards:
            raise RuntimeError(f"{self.name}: wrote {self.written} of {self.shards} shards")
        if self.pending_n:
            self._submit("remainder.tar", concat_blocks(self.pending, self.schema))
        self.pending, self.pending_n = [], 0

    def _submit(self, name: str, block: Block) -> None:
        args = (self.out / self.name / name, block, self.schema, self.opts.block_persons, self.opts.zstd_level)
        if self.pool is None:
            self.futures.append((name, _write_shard_job(args)))
            return
        _bounded(self.futures, 2 * max(1, self.opts.processes))
        self.futures.append((name, self.pool.submit(_write_shard_job, args)))

    def entries(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        done = [(n, f.result() if isinstance(f, Future) else f) for n, f in self.futures]
        shards = [{"file": f"{self.name}/{n}", **e} for n, e in done if n != "remainder.tar"]
        rem = [{"file": f"{self.name}/{n}", **e} for n, e in done if n == "remainder.tar"]
        return shards, (rem[0] if rem else None)


def _bounded(futures: list[tuple[str, Any]], limit: int) -> None:
    live = [f for _, f in futures if isinstance(f, Future) and not f.done()]
    if len(live) >= limit:
        wait(live, return_when=FIRST_COMPLETED)


def _write_shard_job(args: tuple[Path, Block, list[Field], int, int]) -> dict[str, Any]:
    path, block, schema, per_block, level = args
    blocks = (block.slice(s, min(s + per_block, block.n), schema) for s in range(0, block.n, per_block))
    return write_shard(path, blocks, schema, level)


# ---------------------------------------------------------------------------------------------------------------


def _refuse_foreign(out: Path, overwrite: bool) -> None:
    """Refuse a finished dataset (unless overwrite) or a non-empty directory that is not ours (read-only checks)."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    if (out / MANIFEST).exists():
        if not overwrite:
            raise ConvertError(f"{out}: already holds a dataset (manifest.json); pass --overwrite to replace it")
    elif out.exists() and not (out / INCOMPLETE).exists() and any(p.name not in OURS for p in out.iterdir()):
        raise ConvertError(f"{out}: exists, is not empty and is not a dataset; choose an empty or new directory")


@contextlib.contextmanager
def _output_dir(out: Path, overwrite: bool) -> Iterator[list[str]]:
    """Hold ``out``'s lock for the whole conversion (a second one refuses before touching anything), clear what a
    killed conversion left, and yield the files the old dataset's manifest lists (what --overwrite replaces)."""
    _refuse_foreign(out, overwrite)  # before creating the lock file: a refused directory is left as it was
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConvertError(f"{out}: another conversion is writing to it ({LOCK} is locked)") from None
        _refuse_foreign(out, overwrite)  # again under the lock: the other conversion may have finished meanwhile
        _clear_unfinished(out)
        yield _listed_files(out / MANIFEST) if (out / MANIFEST).exists() else []
    finally:
        os.close(fd)  # releases the lock; the empty lock file stays (removing it would let two lock two files)


def _listed_files(manifest: Path) -> list[str]:
    """The shard files a manifest lists, relative to its directory: all that replacing its dataset may delete."""
    try:
        text = manifest.read_text()
        files = [e["file"] for _, e in shard_entries(json.loads(text))] if text.strip() else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConvertError(f"{manifest}: cannot tell which files it lists ({type(e).__name__}: {e}); move the old "
                           "dataset away by hand") from None
    for f in files:
        parts = PurePosixPath(f).parts if isinstance(f, str) else ("..",)
        if not parts or parts[0] in ("/", "..", *OURS) or ".." in parts:
            raise ConvertError(f"{manifest}: lists {f!r}, outside the dataset's own files; not deleting anything")
    return files


def _clear_unfinished(out: Path) -> None:
    """Remove what a killed conversion left: its staging directory and, if it was killed while replacing files,
    the files the old and the new manifest list (both ours; a user's own files are in neither)."""
    mark = out / INCOMPLETE
    if mark.exists():
        if not (out / MANIFEST).exists():  # killed between moving the old manifest aside and placing the new one
            for listing in (mark, out / STAGING / MANIFEST):
                for f in _listed_files(listing) if listing.exists() else []:
                    (out / f).unlink(missing_ok=True)
        mark.unlink()
    shutil.rmtree(out / STAGING, ignore_errors=True)


def _replace(out: Path, stage: Path, old: list[str], new: list[str]) -> None:
    """Move the complete new dataset from ``stage`` into ``out``. The old manifest becomes the INCOMPLETE mark (from
    here the directory is no dataset, and a rerun knows the old files), the old files go, the new ones move in, the
    new manifest last. Nothing else in ``out`` is touched; a file in the way that is not the old dataset's stops it
    before anything moves."""
    keep = set(old)
    clash = [f for f in new if f not in keep and (out / f).exists()]
    if clash:
        raise ConvertError(f"{out / clash[0]}: exists and is not the old dataset's; move it away")
    if (out / MANIFEST).exists():
        os.replace(out / MANIFEST, out / INCOMPLETE)
    else:
        (out / INCOMPLETE).touch()
    for f in old:
        (out / f).unlink(missing_ok=True)
    for f in new:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage / f, out / f)
    os.replace(stage / MANIFEST, out / MANIFEST)
    (out / INCOMPLETE).unlink()
    shutil.rmtree(stage)
    for d in sorted({(out / f).parent for f in old} - {(out / f).parent for f in new}):
        with contextlib.suppress(OSError):  # an old split directory the new dataset lacks, unless it holds user files
            d.rmdir()


def convert_dataset(inputs: list[str], out: str | os.PathLike[str], vocab: str | None = None,
                    opts: ConvertOptions | None = None) -> dict[str, Any]:
    """Convert ``inputs`` into a dataset directory ``out``; returns the manifest. The dataset is built aside (in
    ``out/.conversion-staging``) and replaces an old one only once complete, so a failed conversion leaves it."""
    opts = opts or ConvertOptions()
    check_dtypes(opts.dtypes)
    out = Path(out)
    t0 = time.time()
    try:
        source = open_sources(inputs, vocab, opts.max_seq_len, (opts.time_range_start, opts.time_range_end))
    except SourceError as e:
        raise ConvertError(str(e)) from None
    token_dtype = opts.dtypes.get("tokens") or narrowest_token_dtype(max(source.vocab_size or 65536, 256))
    schema = make_schema(token_dtype, opts.dtypes, source.offline_mlm)
    with _output_dir(out, opts.overwrite) as old_files:
        stage = out / STAGING
        try:
            manifest = _build(source, stage, schema, opts)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        manifest["totals"]["input_rows"] = source.rows
        manifest["params"] = {
            "inputs": [str(Path(p).resolve()) for p in inputs],
            "input_kind": source.kind,
            "vocab": str(Path(vocab).resolve()) if vocab else None,
            "vocab_size": source.vocab_size,
            **{k: v for k, v in asdict(opts).items() if k not in ("overwrite", "progress", "processes")},
            "seconds": round(time.time() - t0, 2),
        }
        write_manifest(stage, manifest)
        _replace(out, stage, old_files, _listed_files(stage / MANIFEST))
    return manifest


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(converter: int) -> None:
    """Pool initializer: the kernel kills the worker when the converter ends, however it ends (a SIGKILL runs no
    cleanup; orphaned workers went on holding their memory and the caller's pipes). The pool forks, so the
    converter is the worker's parent."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != converter:  # it ended before the prctl
        os._exit(1)


def _build(source: Source, stage: Path, schema: list[Field], opts: ConvertOptions) -> dict[str, Any]:
    """Both passes into the empty directory ``stage``; returns the manifest, not yet written."""
    tmp = stage / ".tmp"
    tmp.mkdir(parents=True)
    buckets = max(1, -(-source.rows // BUCKET_PERSONS))
    spill = _Spill(tmp, buckets, schema)
    pool = ProcessPoolExecutor(opts.processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with_parent, initargs=(os.getpid(),)) if opts.processes > 1 else None
    try:
        ids, hist, tokens = _pass1(source, schema, spill, buckets, opts, pool)
        manifest = _pass2(stage, ids, spill, buckets, schema, opts, pool)
    except SourceError as e:
        raise ConvertError(str(e)) from None
    finally:
        spill.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    shutil.rmtree(tmp)
    manifest["length_histogram"] = {"bin_width": 8, "counts": hist.tolist()}
    manifest["totals"]["tokens"] = tokens
    return manifest


def _pass1(source: Source, schema: list[Field], spill: _Spill, buckets: int, opts: ConvertOptions,
           pool: ProcessPoolExecutor | None) -> tuple[np.ndarray, np.ndarray, int]:
    jobs = ((source, t, schema) for t in source.tasks)
    results = _ordered_map(pool, _encode_and_narrow, jobs, 2 * opts.processes) if pool else map(
        _encode_and_narrow, jobs)
    ids: list[np.ndarray] = []
    rows: list[tuple[str, np.ndarray]] = []  # per chunk of ids: its file and rows, to name a duplicated id
    hist = np.zeros(1, dtype=np.int64)
    tokens = 0
    with tqdm(total=len(source.tasks), desc="encode", unit="task", disable=not opts.progress) as bar:
        for path, row, block in results:
            bar.update(1)
            if block.n == 0:
                continue
            pid = block.columns["person_id"]
            bucket = (mix64(pid, opts.seed * 2 + 1) % np.uint64(buckets)).astype(np.int64)
            by_bucket = block.take(np.argsort(bucket, kind="stable"), schema)
            bounds = np.cumsum(np.bincount(bucket, minlength=buckets))
            for b in np.nonzero(np.diff(bounds, prepend=0))[0]:
                spill.add(int(b), by_bucket.slice(int(bounds[b - 1]) if b else 0, int(bounds[b]), schema))
            ids.append(pid.astype(np.int64))
            rows.append((path, row))
            lengths = block.columns["length"].astype(np.int64)
            tokens += int(lengths.sum())
            hb = lengths // 8
            if hb.max() >= len(hist):
                hist = np.concatenate([hist, np.zeros(int(hb.max()) + 1 - len(hist), dtype=np.int64)])
            np.add.at(hist, hb, 1)
    spill.close()
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if len(all_ids) == 0:
        raise ConvertError(f"{source.tasks[0][0] if source.tasks else '?'}: no person left to convert "
                           "(empty input, or every person filtered out)")
    uniq, counts = np.unique(all_ids, return_counts=True)
    if (counts > 1).any():
        pid = uniq[counts > 1][0]
        at = [f"{path}: row {r}" for chunk, (path, row) in zip(ids, rows, strict=True) for r in row[chunk == pid]]
        raise ConvertError(f"{at[0]}: person id {pid} occurs {len(at)} times (also {', '.join(at[1:])})")
    return all_ids, hist, tokens


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


def _val_mask(ids: np.ndarray, opts: ConvertOptions) -> np.ndarray:
    """Deterministic split: a seeded hash of the person id; --num-val takes the N smallest hashes."""
    h = mix64(ids, opts.seed * 2)
    if opts.num_val is not None:
        if opts.num_val >= len(ids):
            raise ConvertError(f"--num-val {opts.num_val} leaves no training persons ({len(ids)} in all)")
        if opts.num_val == 0:
            return np.zeros(len(ids), dtype=bool)
        threshold = np.partition(h, opts.num_val - 1)[opts.num_val - 1]
        return h <= threshold
    return h < np.uint64(min(opts.val_fraction, 1.0) * float(2**64 - 1))


def _pass2(out: Path, ids: np.ndarray, spill: _Spill, buckets: int, schema: list[Field], opts: ConvertOptions,
           pool: ProcessPoolExecutor | None) -> dict[str, Any]:
    val_ids = np.sort(ids[_val_mask(ids, opts)])
    counts = {"train": len(ids) - len(val_ids), "val": len(val_ids)}
    if opts.with_all:
        counts["all"] = len(ids)
    writers: dict[str, _SplitWriter] = {}
    for name, n in counts.items():
        if n == 0:
            continue
        s = shard_count(n, opts)
        (out / name).mkdir()
        writers[name] = _SplitWriter(name, out, s, n // s, opts, schema, pool)
    total_shards = sum(w.shards + 1 for w in writers.values())
    with tqdm(total=total_shards, desc="shards", unit="shard", disable=not opts.progress) as bar:
        for b in range(buckets):
            blocks = spill.read(b)
            if not blocks:
                continue
            merged = concat_blocks(blocks, schema)
            merged = merged.take(np.random.default_rng([opts.seed, b, 7]).permutation(merged.n), schema)
            is_val = np.isin(merged.columns["person_id"], val_ids, assume_unique=False)
            for name, w in writers.items():
                sel = np.nonzero(is_val if name == "val" else ~is_val if name == "train" else np.ones_like(is_val))[0]
                before = w.written
                w.add(merged.take(sel, schema))
                bar.update(w.written - before)
        for w in writers.values():
            w.finish()
        splits = {}
        for name, w in writers.items():
            shards, rem = w.entries()
            splits[name] = {
                "persons": counts[name],
                "shard_persons": w.per_shard,
                "shards": shards,
                "remainder": rem,
            }
        bar.update(bar.total - bar.n)
    every = [e for s in splits.values() for e in s["shards"] + ([s["remainder"]] if s["remainder"] else [])]
    return {
        "format_version": FORMAT_VERSION,
        "schema": [f.to_json() for f in schema],
        "block_persons": opts.block_persons,
        "splits": splits,
        "totals": {
            "persons": len(ids),
            "bytes": sum(e["bytes"] for e in every),
            "shards": len(every),
        },
        "fingerprint": fingerprint(schema, [e["sha256"] for e in every]),
    }


