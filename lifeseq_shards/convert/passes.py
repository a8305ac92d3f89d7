"""Input files -> equal-sized, shuffled, checksummed shards + manifest.

Two passes, memory bounded by a bucket, not by the input:
1. tasks (row groups / row ranges) are encoded in a process pool; each person is narrowed to the schema's dtypes
   (a value that does not fit is an error naming file and person), given a split hash and a bucket hash, and
   spilled to a temp bucket file;
2. once the totals are known (shard count, persons per shard, val threshold), the buckets are read one at a time,
   shuffled, and cut into shards of exactly ``n`` persons; the persons that do not fill the last round go to a
   ``remainder`` shard that training skips and inference reads. The manifest is written last.

An array task (``share``) of a source that can survey (parquet) first surveys every person (id, length, drop
reason: no tokens), which fixes where everyone goes (share.py), then encodes and spills only the persons of its own
shards; the rest of pass 1 and pass 2 are the single conversion's, so its shards are that conversion's, byte for byte.

This module reads top-down: :func:`convert_dataset`, then what it calls. Pass 1's encoding and spilling is encode.py;
the output directory's lock, staging and replacement are outdir.py; the temp bucket files and the shard writers are
writers.py.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..progress import progress_bar
from ..store.format import (
    FORMAT_VERSION,
    MIN_SHARD_PERSONS,
    STAMPS,
    Field,
    concat_blocks,
    make_schema,
    narrowest_token_dtype,
)
from ..store.manifest import Histogram, Manifest, Split, Totals, fingerprint, write_manifest
from ..store.writes import writing
from .encode import HISTOGRAM_BIN, encode_pass, mix64, survey_pass
from .outdir import STAGING, ConvertError, output_dir, replace_dataset
from .share import Cut, cuts, selection
from .sources import Source, SourceError, open_sources
from .writers import Spill, SplitWriter

__all__ = ["ConvertError", "ConvertOptions", "Share", "check_dtypes", "convert_dataset", "shard_count"]

# Shard counts with many divisors, so that most nodes x GPUs x workers products divide them.
HIGHLY_COMPOSITE = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040]
BUCKET_PERSONS = 100_000
# what --dtype may set (a count field such as `length` sets every count and position in a sequence with it)
DTYPE_FIELDS = ("tokens", "length", *STAMPS)
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


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

    @property
    def readers(self) -> int:
        """nodes x gpus x workers, each 1 when not given: the readers a split's shards must divide among."""
        return (self.nodes or 1) * (self.gpus or 1) * (self.workers or 1)


@dataclass(frozen=True)
class Share:
    """Which part of the conversion to write: task ``task`` of ``tasks`` writes the contiguous run of shards
    ``task * S // tasks`` .. ``(task + 1) * S // tasks - 1`` of each split of S shards, the last task the remainders
    too (convert/array.py). Every task cuts the same shards from the same stream, so the parts together are the one
    conversion's shards, byte for byte."""

    task: int = 0
    tasks: int = 1

    def shards(self, total: int) -> tuple[int, int]:
        """[first, stop) of this task's shards of a split of ``total`` shards."""
        return self.task * total // self.tasks, (self.task + 1) * total // self.tasks

    @property
    def last(self) -> bool:
        return self.task == self.tasks - 1


def convert_dataset(inputs: list[str], out: str | os.PathLike[str], vocab: str | None = None,
                    opts: ConvertOptions | None = None) -> Manifest:
    """Convert ``inputs`` into a dataset directory ``out``; returns the manifest. The dataset is built aside (in
    ``out/.conversion-staging``) and replaces an old one only once complete, so a failed conversion leaves it."""
    opts = opts or ConvertOptions()
    source, schema = prepare(inputs, vocab, opts)
    out = Path(out)
    with output_dir(out, opts.overwrite) as old_files:
        staging = out / STAGING
        kept = "the conversion stopped and nothing of it is kept" + (", the old dataset is unchanged" if old_files
                                                                      else "")
        manifest, _, _ = build_part(inputs, vocab, opts, source, schema, staging, kept, Share())
        replace_dataset(out, staging, old_files, manifest.files())
    return manifest


def prepare(inputs: list[str], vocab: str | None, opts: ConvertOptions) -> tuple[Source, list[Field]]:
    """The options checked, the inputs opened and the schema chosen: everything refused before any encoding, and
    before the output directory exists."""
    check_dtypes(opts.dtypes)
    _check_shards(opts)
    try:
        source = open_sources(inputs, vocab, opts.max_seq_len, (opts.time_range_start, opts.time_range_end))
    except SourceError as e:
        raise ConvertError(str(e)) from None
    if opts.num_val is not None and opts.num_val >= source.rows:
        raise ConvertError(f"--num-val {opts.num_val} leaves no training persons ({source.rows} in all)")
    token_dtype = opts.dtypes.get("tokens") or narrowest_token_dtype(max(source.vocab_size or 65536, 256))
    return source, make_schema(token_dtype, opts.dtypes, source.offline_mlm)


def build_part(inputs: list[str], vocab: str | None, opts: ConvertOptions, source: Source, schema: list[Field],
               staging: Path, kept: str, share: Share) -> tuple[Manifest, str, int]:
    """Both passes into the new directory ``staging``, then its manifest (the last file written): the whole dataset,
    or (``share``) one task's shards with a manifest of only those. Returns (the manifest, the digest of every input
    row's person id, which tasks compare, the persons encoded). A failure removes ``staging`` and says ``kept``."""
    t0 = time.time()
    try:
        with writing(staging, kept):  # a full disk, a file-size limit: one line naming the file
            passes = _build(source, staging, schema, opts, share)
            params = {**conversion_params(inputs, vocab, opts, source), "seconds": round(time.time() - t0, 2)}
            manifest = _manifest(schema, opts, passes, source.rows, params)
            write_manifest(staging, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest, passes.input_digest, passes.encoded


def conversion_params(inputs: list[str], vocab: str | None, opts: ConvertOptions, source: Source) -> dict[str, Any]:
    """What the manifest's ``params`` records of the conversion but its time: the input and the options that shape
    the dataset (not --overwrite, --progress or --processes)."""
    return {
        "inputs": [str(Path(p).resolve()) for p in inputs],
        "input_kind": source.kind,
        "vocab": str(Path(vocab).resolve()) if vocab else None,
        "vocab_size": source.vocab_size,
        **{k: v for k, v in asdict(opts).items() if k not in ("overwrite", "progress", "processes")},
    }


def check_dtypes(dtypes: dict[str, str]) -> None:
    """Refuse an override that would be ignored (an unknown field, a typo) or could not hold the values exactly."""
    for name, dtype in dtypes.items():
        if name not in DTYPE_FIELDS:
            raise ConvertError(f"--dtype {name}={dtype}: no field {name!r} to set (fields: {', '.join(DTYPE_FIELDS)})")
        if dtype not in INT_DTYPES:
            raise ConvertError(f"--dtype {name}={dtype}: not an integer dtype (one of {', '.join(INT_DTYPES)})")


def _check_shards(opts: ConvertOptions) -> None:
    """--shards with --nodes/--gpus/--workers: the count must divide among those readers (else which one wins?)."""
    readers = opts.readers
    if opts.shards and opts.shards % readers:
        raise ConvertError(f"--shards {opts.shards} does not divide into {opts.nodes or 1} x {opts.gpus or 1} x "
                           f"{opts.workers or 1} = {readers} readers (nodes x gpus x workers); give a multiple of "
                           f"{readers}, or only one of the two")


@dataclass(frozen=True)
class _Passes:
    """What the two passes found and wrote: the manifest's content but for the conversion's parameters."""

    persons: int
    tokens: int
    histogram: np.ndarray  # persons by length // HISTOGRAM_BIN
    splits: dict[str, Split]
    dropped: dict[str, int]  # input rows the source dropped, by reason (sources/drops.py)
    input_digest: str  # sha256 of every input row's person id, sorted: what array tasks compare
    encoded: int  # persons encoded: all of them, or an array task's share (share.py)


def _build(source: Source, staging: Path, schema: list[Field], opts: ConvertOptions, share: Share) -> _Passes:
    """Both passes into the empty directory ``staging`` (the manifest is not written yet)."""
    tmp = staging / ".tmp"
    tmp.mkdir(parents=True)
    buckets = max(1, -(-source.rows // BUCKET_PERSONS))
    spill = Spill(tmp, buckets, schema)
    pool = ProcessPoolExecutor(opts.processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with_parent, initargs=(os.getpid(),)) if opts.processes > 1 else None
    try:
        # an array task of a source that can survey: everyone's ids and lengths, then only its share encoded
        surveyed = share.tasks > 1 and source.survey is not None
        if surveyed:
            tally = survey_pass(source, opts.processes, pool, opts.progress)
        else:
            tally = encode_pass(source, schema, spill, buckets, opts.seed, opts.processes, pool, opts.progress)
        ids, hist, tokens, dropped, digest = tally.found(source)
        members = _members(ids, opts)
        writers = _writers(staging, members, schema, opts, pool, share)
        spans = {name: w.span for name, w in writers.items()}
        encoded = len(ids)
        if surveyed:
            wanted = np.concatenate([c.wanted for cut in cuts(ids, members, opts.seed, buckets, spans)
                                     for c in cut.values()])
            select = selection(ids, tally.counts, wanted)
            encoded = encode_pass(source, schema, spill, buckets, opts.seed, opts.processes, pool, opts.progress,
                                  select).persons
        splits = _pass2(writers, spill, cuts(ids, members, opts.seed, buckets, spans), schema, opts)
    except SourceError as e:
        raise ConvertError(str(e)) from None
    except BrokenProcessPool:  # every pending task fails with it, so which one's process died is not known
        raise ConvertError(f"{staging.parent}: a conversion process died (killed by a signal: out of memory?); nothing "
                           f"was written; rerun, with fewer --processes (now {opts.processes}) if memory is "
                           "short") from None
    finally:
        spill.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    shutil.rmtree(tmp)
    return _Passes(len(ids), tokens, hist, splits, dropped, digest, encoded)


def _manifest(schema: Sequence[Field], opts: ConvertOptions, passes: _Passes, input_rows: int,
              params: dict[str, Any]) -> Manifest:
    """The one place a manifest is made: totals and fingerprint over every shard file, remainders included."""
    every = [e for s in passes.splits.values() for e in s.entries()]
    totals = Totals(persons=passes.persons, bytes=sum(e.bytes for e in every), shards=len(every),
                    tokens=passes.tokens, input_rows=input_rows, dropped=passes.dropped)
    return Manifest(FORMAT_VERSION, tuple(schema), opts.block_persons, passes.splits, totals,
                    fingerprint(schema, [e.sha256 for e in every]),
                    Histogram(HISTOGRAM_BIN, tuple(passes.histogram.tolist())), params)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(converter: int) -> None:
    """Pool initializer: the kernel kills the worker when the converter ends, however it ends (a SIGKILL runs no
    cleanup, and orphans would hold their memory and the caller's pipes). The pool forks, so the converter is the
    worker's parent."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != converter:  # it ended before the prctl
        os._exit(1)


# ---------------------------------------------------------------------------------------------------------------
# pass 2: shuffle each bucket and cut shards of exactly n persons


def _members(ids: np.ndarray, opts: ConvertOptions) -> dict[str, np.ndarray]:
    """Each split's persons: a mask over ``ids``."""
    is_val = _val_mask(ids, opts)
    members = {"train": ~is_val, "val": is_val}
    if opts.with_all:
        members["all"] = np.ones(len(ids), dtype=bool)
    return members


def _writers(out: Path, members: dict[str, np.ndarray], schema: list[Field], opts: ConvertOptions,
             pool: ProcessPoolExecutor | None, share: Share) -> dict[str, SplitWriter]:
    """A writer (and its directory) for each split that has persons, set to write ``share``'s shards of it."""
    writers: dict[str, SplitWriter] = {}
    for name, member in members.items():
        n = int(member.sum())
        if n == 0:
            continue
        s = shard_count(n, opts, name)
        (out / name).mkdir()
        first, stop = share.shards(s)
        writers[name] = SplitWriter(name, out, s, n // s, schema, opts.block_persons, opts.zstd_level, pool,
                                    2 * opts.processes, first=first, stop=stop, remainder=share.last, persons=n)
    return writers


def _pass2(writers: dict[str, SplitWriter], spill: Spill, streams: Iterator[dict[str, Cut]], schema: list[Field],
           opts: ConvertOptions) -> dict[str, Split]:
    """Each bucket's spilled persons put in its cuts' order (share.py) and given to the writers; a bucket none of
    whose persons a writer writes is not read."""
    total_shards = sum(w.stop - w.first + w.remainder for w in writers.values())
    with progress_bar(total=total_shards, desc="shards", unit="shard", disable=not opts.progress) as bar:
        for b, cut in enumerate(streams):
            if not any(c.hi > c.lo for c in cut.values()):
                for name, w in writers.items():
                    w.skip(len(cut[name].ids))
                continue
            merged = concat_blocks(spill.read(b), schema)
            pid = merged.columns["person_id"]
            by_id = np.argsort(pid)
            for name, w in writers.items():
                c = cut[name]
                w.skip(c.lo)
                if c.hi > c.lo:
                    before = w.written
                    w.add(merged.take(by_id[np.searchsorted(pid, c.wanted, sorter=by_id)], schema))
                    bar.update(w.written - before)
                w.skip(len(c.ids) - c.hi)
        for w in writers.values():
            w.finish()
        splits = {name: w.split() for name, w in writers.items()}
        bar.update(bar.total - bar.n)
    return splits


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
    val = h < np.uint64(min(opts.val_fraction, 1.0) * float(2**64 - 1))
    if val.all():  # as --num-val: a dataset without a train split is no conversion anyone asked for
        raise ConvertError(f"--val-fraction {opts.val_fraction} leaves no training persons ({len(ids)} in all)")
    return val


def shard_count(persons: int, opts: ConvertOptions, split: str = "") -> int:
    """Shards for ``split`` of ``persons``: exactly --shards, else a multiple of nodes x gpus x workers, else the
    largest highly composite number that keeps >= min_shard_persons per shard (so < 1 % fall in the remainder)."""
    if persons == 0:
        return 0
    # which split is too small, and what changes its size
    of = f"split {split} (--val-fraction / --num-val set its size)" if split else "a split"
    if opts.shards:
        if opts.shards > persons:
            raise ConvertError(f"--shards {opts.shards} is more than the {persons} persons of {of}")
        return opts.shards
    default = max([h for h in HIGHLY_COMPOSITE if h * opts.min_shard_persons <= persons] or [1])
    readers = opts.readers
    if readers == 1:
        return default
    if readers > persons:
        raise ConvertError(f"{readers} readers (nodes x gpus x workers) is more than the {persons} persons of {of}")
    return readers * max(1, default // readers)
