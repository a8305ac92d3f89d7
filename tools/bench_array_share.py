"""What an array task does of the whole conversion: the CPU seconds of one conversion and of a task of K, phase by
phase, in one run.

Per K (``--tasks``), task 0 and task K-1 convert their share of one synthetic population (``shardify synth``, lengths
drawn like the researchers'), one process each, one after the other in this process; the single conversion first.
Each is timed in CPU seconds (``time.process_time``: another user's load slows it far less than the wall time) and
split into its phases: ``survey`` (an array task's look at everyone: ids, lengths, drops), ``encode`` (tokens and
spill; a task: its share) and ``pass2`` (shuffle and shard writing; a task: its shards). The ratio is the task's CPU
time over the single conversion's: what a task of K costs, and what of it every task pays whatever K is. Last, the
single conversion with 2 processes: the CPU seconds of the converting process itself (``parent``: reading the pool's
results, the spill, pass 2's shuffle) and of its pool's workers (``workers``: encoding, shard compression), the part
that more processes cannot divide and the part they can.

Usage: python -m tools.bench_array_share [--persons 150000] [--tasks 2 4 8] [--work bench-share] [--out CSV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.common import write_csv

PHASES = {"survey_pass": "survey", "encode_pass": "encode", "_pass2": "pass2"}


@contextlib.contextmanager
def _timed(spent: dict[str, float]) -> Iterator[None]:
    """The converter's phases wrapped meanwhile, so that each adds its CPU seconds to ``spent``."""
    from lifeseq_shards.convert import passes

    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - start
        return timed

    real = {fn: getattr(passes, fn) for fn in PHASES}
    try:
        for fn, name in PHASES.items():
            setattr(passes, fn, wrap(real[fn], name))
        yield
    finally:
        for fn, f in real.items():
            setattr(passes, fn, f)


def measure(work: Path, persons: int, ks: list[int]) -> list[dict[str, Any]]:
    from lifeseq_shards.convert.array import TASK_JSON, convert_task, task_name
    from lifeseq_shards.convert.outdir import TASKS
    from lifeseq_shards.convert.passes import ConvertOptions, Share, convert_dataset
    from lifeseq_shards.convert.sources.synth import synth_population

    raw = work / "raw"
    shutil.rmtree(work, ignore_errors=True)
    synth_population(raw, persons, 0, progress=False)
    inputs, vocab = [str(raw / "sequences.parquet")], str(raw / "vocab.csv")
    opts = ConvertOptions(nodes=4, gpus=4, workers=2, processes=1, progress=False)
    spent: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    for k, task in [(1, 0), *((n, i) for n in ks for i in (0, n - 1))]:
        out = work / "ds"
        shutil.rmtree(out, ignore_errors=True)
        spent.clear()
        load, start = os.getloadavg()[0], time.process_time()
        with _timed(spent):
            if k == 1:
                m = convert_dataset(inputs, out, vocab, opts)
            else:
                m, _ = convert_task(inputs, out, vocab, opts, Share(task, k))
        if k == 1:
            encoded = m.totals.persons
        else:
            encoded = json.loads((out / TASKS / task_name(Share(task, k)) / TASK_JSON).read_text())["encoded"]
        cpu = time.process_time() - start
        rows.append({"persons": m.totals.persons, "tasks": k, "task": task, "encoded": encoded,
                     "cpu_s": round(cpu, 2), **{p: round(spent.get(p, 0.0), 2) for p in PHASES.values()},
                     "load": round(max(load, os.getloadavg()[0]), 1)})
    shutil.rmtree(work / "ds")
    kids, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
    convert_dataset(inputs, work / "ds", vocab, replace(opts, processes=2))
    parent, after = time.process_time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    workers = after.ru_utime + after.ru_stime - kids.ru_utime - kids.ru_stime
    rows.append({"persons": rows[0]["persons"], "tasks": 1, "task": 0, "encoded": rows[0]["persons"],
                 "cpu_s": round(parent + workers, 2), "parent": round(parent, 2), "workers": round(workers, 2),
                 "load": round(os.getloadavg()[0], 1)})
    single = rows[0]["cpu_s"]
    for r in rows:
        r["of_single"] = round(r["cpu_s"] / single, 3)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--persons", type=int, default=150_000)
    p.add_argument("--tasks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--work", type=Path, default=Path("bench-share"))
    p.add_argument("--out", type=Path, default=None, help="write the table as this CSV")
    args = p.parse_args(argv)
    rows = measure(args.work, args.persons, args.tasks)
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out is not None:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
