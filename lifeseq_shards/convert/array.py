"""A conversion as a job array: ``shardify convert --task I --tasks K`` (under SLURM, I and K from the array's
variables) writes task I's share of the shards, and ``shardify merge`` puts the K parts together into the dataset.

Every task reads the whole input (pass 1: the shard counts, the val split and each bucket's place in the stream need
every person) and then cuts only its own contiguous run of each split's shards from the same stream a single
conversion cuts (pass 2, :class:`~lifeseq_shards.convert.passes.Share`): the merged dataset is the single conversion's,
byte for byte, for any K. A task builds its part aside (``OUT/.conversion-tasks/.task-I-of-K.staging``) and renames it
into place (``task-I-of-K``) once its manifest and ``task.json`` are written, so a task killed half-way leaves nothing
that looks finished and its rerun clears what it left; a task already complete with the same options is not redone.
The merge checks that all K parts are there and were made from the same input and options, links their files into the
dataset (no byte copied) and writes the manifest last; a second merge finds the dataset made and does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..store.lengths import index_lengths, write_lengths_index
from ..store.manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    Split,
    Totals,
    fingerprint,
    parse_manifest,
    write_manifest,
)
from ..store.writes import writing
from .outdir import STAGING, TASKS, ConvertError, output_dir, refuse_foreign, replace_dataset
from .passes import ConvertOptions, Share, build_part, conversion_params, prepare

TASK_JSON = "task.json"  # the part's completion record, written after its manifest
_DONE = re.compile(r"task-(\d+)-of-(\d+)")
# params that may differ between the tasks of one array (how long each took, not what it made)
_OWN = ("seconds",)


def task_name(share: Share) -> str:
    return f"task-{share.task:04d}-of-{share.tasks:04d}"


def share_from(task: int | None, tasks: int | None, env: Mapping[str, str]) -> tuple[Share | None, str]:
    """The array task to convert: from --task/--tasks, else from SLURM's array variables, else None (a whole
    conversion). Returns (share, where it came from). ConvertError for what cannot be told apart: one of the two
    options, a task outside the array, or an array whose ids are not one contiguous range (``--array=0-9:2``,
    ``--array=1,5,7``: its task ids are not 0..K-1 after its first)."""
    if (task is None) != (tasks is None):
        raise ConvertError("give both --task and --tasks (or neither: under a SLURM job array they come from "
                           "SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT)")
    if task is not None and tasks is not None:
        if not 0 <= task < tasks:
            raise ConvertError(f"--task {task}: outside 0..{tasks - 1} (--tasks {tasks})")
        return Share(task, tasks), f"--task {task} --tasks {tasks}"
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None, ""
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_COUNT")
    try:
        tid, lo, hi, count = (int(env[n]) for n in names)
    except (KeyError, ValueError):
        given = ", ".join(f"{n}={env.get(n, '(unset)')}" for n in names)
        raise ConvertError(f"SLURM array variables incomplete or not integers ({given}); give --task and "
                           "--tasks") from None
    if hi - lo + 1 != count or not lo <= tid <= hi:
        raise ConvertError(f"SLURM array ids {lo}..{hi} hold {count} tasks (a stepped or listed --array): which "
                           f"share task {tid} converts is ambiguous; submit --array=0-{count - 1}, or give --task "
                           "and --tasks")
    return Share(tid - lo, count), f"SLURM_ARRAY_TASK_ID={tid} of {lo}..{hi}"


def convert_task(inputs: list[str], out: str | os.PathLike[str], vocab: str | None, opts: ConvertOptions,
                 share: Share) -> tuple[Manifest, bool]:
    """Convert task ``share``'s part into ``out/.conversion-tasks/task-I-of-K``; returns (the part's manifest,
    whether it was converted now: False when it was already complete, made with the same options). A part made with
    other options is refused unless ``opts.overwrite``, and so are the parts of another --tasks."""
    source, schema = prepare(inputs, vocab, opts)
    out = Path(out)
    refuse_foreign(out, opts.overwrite)
    tasks = out / TASKS
    tasks.mkdir(parents=True, exist_ok=True)
    done, staging = tasks / task_name(share), tasks / f".{task_name(share)}.staging"
    with _locked(tasks / f".{task_name(share)}.lock"):
        other = sorted({m.group(2) for p in tasks.iterdir() if (m := _DONE.fullmatch(p.name))} - {f"{share.tasks:04d}"})
        if other:
            raise ConvertError(f"{tasks}: holds parts of --tasks {int(other[0])}, not {share.tasks}; remove {tasks} to "
                               f"start again with {share.tasks} tasks")
        if done.exists():
            part = _read_part(done)
            change = _differs(part.manifest.params or {}, conversion_params(inputs, vocab, opts, source))
            if change is None:
                return part.manifest, False
            if not opts.overwrite:
                raise ConvertError(f"{done}: complete, made with other options ({change}); give the same options, or "
                                   "--overwrite to convert it again")
        shutil.rmtree(staging, ignore_errors=True)  # what a killed run of this task left
        kept = "this task's part is not kept; run the task again"
        t0 = time.time()
        manifest, digest, encoded = build_part(inputs, vocab, opts, source, schema, staging, kept, share)
        with writing(staging / TASK_JSON, kept):
            (staging / TASK_JSON).write_text(json.dumps({"task": share.task, "tasks": share.tasks,
                                                        "input_digest": digest, "encoded": encoded,
                                                        "seconds": round(time.time() - t0, 2)}))
            shutil.rmtree(done, ignore_errors=True)  # an --overwrite of a part made with other options
            os.rename(staging, done)
    return manifest, True


def merge_tasks(out: str | os.PathLike[str], overwrite: bool = False) -> tuple[Manifest, bool]:
    """Merge the complete parts in ``out/.conversion-tasks`` into the dataset ``out``; returns (its manifest, whether
    it was merged now: False when it already was). Refused in one line naming the task when a part is missing or
    differs from task 0 (input, options, what pass 1 found), before anything is written. The shards are linked
    into place (no byte copied where the filesystem links), the lengths indexes joined, the manifest written last
    (through the same replacement as a conversion's: an old dataset only with ``overwrite``); then the parts go."""
    out = Path(out)
    tasks = out / TASKS
    if not tasks.is_dir():
        if (out / MANIFEST).exists():
            return _read_manifest(out / MANIFEST), False
        raise ConvertError(f"{out}: no array tasks to merge (no {TASKS}); run `shardify convert ... --task I --tasks "
                           "K` first")
    parts = _complete_parts(out, tasks)
    first = parts[0].manifest
    every = [e for part in parts for split in part.manifest.splits.values() for e in split.entries()]
    order = {name: i for i, name in enumerate(first.splits)}
    every.sort(key=lambda e: (order[e.file.split("/")[0]], e.file.endswith("/remainder.tar"), e.file))
    print_ = fingerprint(first.schema, [e.sha256 for e in every])
    if (out / MANIFEST).exists() and _read_manifest(out / MANIFEST).fingerprint == print_:
        shutil.rmtree(tasks)  # merged before, and stopped before removing the parts
        return _read_manifest(out / MANIFEST), False
    with output_dir(out, overwrite) as old_files:
        staging = out / STAGING
        kept = "the merge stopped; the tasks' parts are kept, merge again"
        try:
            with writing(staging, kept):
                splits = {name: _merge_split(staging, name, [p for p in parts if name in p.manifest.splits], first)
                          for name in first.splits}
                entries = [e for s in splits.values() for e in s.entries()]
                totals = Totals(first.totals.persons, sum(e.bytes for e in entries), len(entries), first.totals.tokens,
                                first.totals.input_rows, first.totals.dropped)
                seconds = max(float((p.manifest.params or {}).get("seconds", 0)) for p in parts)
                manifest = Manifest(first.format_version, first.schema, first.block_persons, splits, totals, print_,
                                    first.length_histogram, {**(first.params or {}), "seconds": seconds})
                write_manifest(staging, manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        replace_dataset(out, staging, old_files, manifest.files())
    shutil.rmtree(tasks)
    return manifest, True


@dataclass(frozen=True)
class _Part:
    where: Path
    manifest: Manifest
    record: dict[str, Any]  # task.json


def _read_part(done: Path) -> _Part:
    try:
        record = json.loads((done / TASK_JSON).read_text())
        manifest = parse_manifest((done / MANIFEST).read_bytes(), str(done / MANIFEST))
    except (OSError, ValueError) as e:
        raise ConvertError(f"{done}: not a complete part ({type(e).__name__}: {e}); run its task again") from None
    return _Part(done, manifest, record)


def _read_manifest(path: Path) -> Manifest:
    try:
        return parse_manifest(path.read_bytes(), str(path))
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror or e})") from None


def _complete_parts(out: Path, tasks: Path) -> list[_Part]:
    """The K parts, read, in task order, once every one is complete and each was made like task 0's."""
    done = {(int(m.group(1)), int(m.group(2))) for p in tasks.iterdir() if (m := _DONE.fullmatch(p.name))}
    counts = sorted({k for _, k in done})
    if len(counts) != 1:
        raise ConvertError(f"{tasks}: " + (f"holds parts of --tasks {' and '.join(map(str, counts))}; remove the "
                                           "ones of the array not merged" if counts else "no task is complete yet"))
    k = counts[0]
    missing = [i for i in range(k) if (i, k) not in done]
    if missing:
        running = [i for i in missing if (tasks / f".{task_name(Share(i, k))}.staging").exists()]
        which = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ConvertError(f"{out}: task{'s' if len(missing) > 1 else ''} {which} of {k} not complete"
                           + (f" ({len(running)} of them still running or killed)" if running else "")
                           + f"; run {'them' if len(missing) > 1 else 'it'} again (--task I --tasks {k}, or submit "
                           "the array again: complete tasks are not converted again), then merge")
    parts = [_read_part(tasks / task_name(Share(i, k))) for i in range(k)]
    for i, part in enumerate(parts[1:], 1):
        change = _part_differs(parts[0], part)
        if change:
            raise ConvertError(f"{out}: task {i} of {k} was not made like task 0 ({change}); run the tasks that "
                               "differ again with the same input and options, then merge")
    return parts


def _part_differs(a: _Part, b: _Part) -> str | None:
    """What differs between two parts in what every task of one array computes alike, or None."""
    ma, mb = a.manifest, b.manifest
    change = _differs(ma.params or {}, mb.params or {})
    if change:
        return change
    if a.record.get("input_digest") != b.record.get("input_digest"):
        return "other input: its persons' ids differ"
    found = {"schema": (ma.schema, mb.schema), "persons": (ma.totals.persons, mb.totals.persons),
             "tokens": (ma.totals.tokens, mb.totals.tokens), "dropped": (ma.totals.dropped, mb.totals.dropped),
             "length histogram": (ma.length_histogram, mb.length_histogram),
             "splits": ({n: (s.persons, s.shard_persons) for n, s in ma.splits.items()},
                        {n: (s.persons, s.shard_persons) for n, s in mb.splits.items()})}
    return next((f"other input: its {what} differ" for what, (x, y) in found.items() if x != y), None)


def _differs(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """The first key whose value differs ('seed 1, now 0'), or None."""
    for key in sorted(set(a) | set(b)):
        if key not in _OWN and a.get(key) != b.get(key):
            return f"{key} {a.get(key)!r}, here {b.get(key)!r}"
    return None


def _merge_split(staging: Path, name: str, parts: list[_Part], first: Manifest) -> Split:
    """One split of the dataset from the parts' runs of its shards: each shard file linked into ``staging``, checked
    against its part's entry (name, size), and their lengths indexes joined into the split's."""
    shards, remainder, lengths = [], None, []
    for part in parts:
        split = part.manifest.splits[name]
        for e in split.entries():
            src, dst = part.where / e.file, staging / e.file
            size = src.stat().st_size if src.exists() else -1
            if size != e.bytes:
                raise ConvertError(f"{src}: {size} bytes, its part's manifest lists {e.bytes}; run its task again")
            dst.parent.mkdir(parents=True, exist_ok=True)
            _link(src, dst)
        shards.extend(split.shards)
        remainder = split.remainder or remainder
        if split.lengths is not None:
            data = (part.where / split.lengths.file).read_bytes()
            try:
                lengths.append(index_lengths(data, split.lengths, sum(e.samples for e in split.entries())))
            except ValueError as e:
                raise ConvertError(f"{part.where / split.lengths.file}: {e}; run its task again") from None
    info = first.splits[name]
    want = [f"{name}/shard-{i:06d}.tar" for i in range(len(shards))]
    if [e.file for e in shards] != want or sum(e.samples for e in [*shards, *([remainder] if remainder else [])]) \
            != info.persons:
        raise ConvertError(f"{staging.parent / TASKS}: the parts' shards of split {name} do not make the split "
                           f"({len(shards)} shards); run the tasks again")
    index = write_lengths_index(staging, name, np.concatenate(lengths), first.schema)
    return Split(info.persons, info.shard_persons, tuple(shards), remainder, index)


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src``: no byte copied, and the part keeps its file until the merge is done
    (a merge stopped half-way is merged again from the parts). A filesystem without hard links gets a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One run of a task at a time (a requeued task and its first run, a task started twice by hand)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConvertError(f"{path.parent}: task {path.name[1:-5]} is running in another process ({path.name} is "
                               "locked)") from None
        yield
    finally:
        os.close(fd)
