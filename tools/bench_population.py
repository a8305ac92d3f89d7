"""Population benchmark: the whole path at growing sizes, on this machine, each stage timed with its peak memory.

One command, one run. Per population size (``--persons``): ``shardify synth`` writes a step-4 parquet with the
researchers' lengths, then each stage runs in a fresh subprocess (so each peak RSS is its own):

- ``convert-1``, ``convert-2``: ``convert_dataset`` with 1 and 2 processes, for 4 nodes x 4 GPUs x 2 workers;
- ``array-K``: the same conversion as K array tasks (``--task I --tasks K``, processes started at once, one process
  each), then ``merge``; the merged dataset's fingerprint must be the single conversion's, or the bench stops;
- ``plan``: `shardify plan` of the train split for 4 x 4 x 2 readers, batches of persons and a token budget;
- ``read``: one pass over the train split by one reader (no workers), every batch collated;
- ``embed``: persons (train and val) embedded by one process with a tiny reference model (fp32, CPU), one Parquet
  file per shard: the first ``--embed-batches`` batches (the model's time is per person; 0: everyone).

Peak memory is the largest RSS of the stage's process and of the processes it waited for (a pool's workers):
``getrusage`` of itself and of its children; ``cpu_s`` their CPU seconds (user + system), which another user's load
slows far less than the wall time. The spill (the first pass's temp files) is measured at its largest. Each row
carries the 1-minute load average, the larger of the stage's start and end. An array task records the persons it
encoded (its share) beside the slower task's time. Machines are shared and noisy: the ratios within a size are of
this run. The table and plot are written again after each size, so a run stopped later keeps the sizes done.

Usage: python -m tools.bench_population [--persons 100000 300000 1000000] [--tasks 2] [--scaling-up-to N]
[--work bench-population] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.common import write_csv

ARRANGEMENT = ("--nodes", "4", "--gpus", "4", "--workers", "2")  # 4 nodes x 4 GPUs x 2 DataLoader workers
BATCH = 256
TOKENS_PER_BATCH = 65536
EMBED_SIZE = (16, 32, 1, 2)  # hidden, ff, layers, heads: tiny, so that a CPU embeds a million persons in minutes


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def peak_rss_mb() -> float:
    """The largest RSS of this process (VmHWM: getrusage's own ru_maxrss also counts the parent's at the fork) and
    of the children it waited for, a pool's workers (MiB)."""
    own = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


# -- the stages, each run in its own process ----------------------------------------------------------------------
def job_synth(raw: str, persons: str) -> dict[str, Any]:
    from lifeseq_shards.convert.sources.synth import synth_population

    start = time.perf_counter()
    synth_population(raw, int(persons), 0, progress=False)
    return {"seconds": time.perf_counter() - start, "persons": int(persons),
            "bytes": (Path(raw) / "sequences.parquet").stat().st_size}


def job_convert(raw: str, out: str, processes: str, task: str = "", tasks: str = "") -> dict[str, Any]:
    from lifeseq_shards.convert import writers
    from lifeseq_shards.convert.array import TASK_JSON, convert_task, task_name
    from lifeseq_shards.convert.outdir import TASKS
    from lifeseq_shards.convert.passes import ConvertOptions, Share, convert_dataset

    spill = [0]
    close = writers.Spill.close

    def measured(self: writers.Spill) -> None:
        spill[0] = max(spill[0], sum(p.stat().st_size for p in self.paths if p.exists()))
        close(self)

    writers.Spill.close = measured  # type: ignore[method-assign]
    inputs, vocab = [f"{raw}/sequences.parquet"], f"{raw}/vocab.csv"
    opts = ConvertOptions(nodes=4, gpus=4, workers=2, processes=int(processes), progress=False)
    start = time.perf_counter()
    if task:
        share = Share(int(task), int(tasks))
        m, _ = convert_task(inputs, out, vocab, opts, share)
        record = json.loads((Path(out) / TASKS / task_name(share) / TASK_JSON).read_text())
        encoded = record["encoded"]
    else:
        m = convert_dataset(inputs, out, vocab, opts)
        encoded = m.totals.persons
    return {"seconds": time.perf_counter() - start, "persons": m.totals.persons, "fingerprint": m.fingerprint,
            "bytes": m.totals.bytes, "spill_bytes": spill[0], "encoded": encoded}


def job_merge(out: str) -> dict[str, Any]:
    from lifeseq_shards.convert.array import merge_tasks

    start = time.perf_counter()
    m, _ = merge_tasks(out)
    return {"seconds": time.perf_counter() - start, "persons": m.totals.persons, "fingerprint": m.fingerprint}


def job_plan(root: str) -> dict[str, Any]:
    from lifeseq_shards.plan.asked import Topology
    from lifeseq_shards.plan.report import describe, describe_tokens
    from lifeseq_shards.store.lengths import split_lengths
    from lifeseq_shards.store.remote import read_manifest

    start = time.perf_counter()
    m = read_manifest(root)
    info = m.splits["train"]
    topology = Topology(4, 4, 2)
    persons = describe([s.samples for s in info.shards], info.remainder_persons, topology, BATCH, split="train")
    lengths, sizes = split_lengths(root, m, "train")
    if info.remainder is None:
        sizes.append(0)
    tokens = describe_tokens(lengths, sizes, topology, TOKENS_PER_BATCH, batch_size=BATCH)
    if not (persons.ok and tokens.ok):
        raise RuntimeError(f"plan refused:\n{persons.text}\n{tokens.text}")
    return {"seconds": time.perf_counter() - start, "persons": info.persons}


def job_read(root: str) -> dict[str, Any]:
    from lifeseq_shards import ShardedDataset, ShardedLoader
    from lifeseq_shards.reader import World

    start, persons = time.perf_counter(), 0
    for batch in ShardedLoader(ShardedDataset(root, split="train", batch_size=BATCH, world=World(0, 1))):
        persons += len(batch["person_id"])
    return {"seconds": time.perf_counter() - start, "persons": persons}


def job_embed(root: str, out: str, batches: str) -> dict[str, Any]:
    import torch

    from lifeseq_shards import EmbeddingWriter, ShardedLoader
    from lifeseq_shards.device.build import BatchBuilder
    from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule
    from lifeseq_shards.reader import World
    from lifeseq_shards.store.remote import read_manifest

    torch.manual_seed(0)
    model = LifeSeqPretrainModule(EncoderConfig(*EMBED_SIZE), int(read_manifest(root).vocab_size),
                                  dropout=0.0).eval()
    start, persons, first, after = time.perf_counter(), 0, 0.0, 0
    writer = EmbeddingWriter(out)
    builder = BatchBuilder()
    with torch.no_grad():
        for i, batch in enumerate(ShardedLoader(writer.dataset(root, batch_size=BATCH, model=model,
                                                               world=World(0, 1)))):
            model_batch = builder(batch, "cpu", 0)
            writer.write(model.predict_step(model_batch, i), model_batch)
            persons += len(model_batch["person_id"])
            if i == 0:  # the loader's and the writer's start: the steady rate is measured after it
                first, after = time.perf_counter() - start, persons
            if i + 1 == int(batches):  # the model's time is per person: the first batches give its rate
                break
        else:
            writer.finish()
    seconds = time.perf_counter() - start
    steady = (persons - after) / (seconds - first) if persons > after else 0.0
    return {"seconds": seconds, "persons": persons, "first_batch_s": first, "steady_persons_s": round(steady, 1)}


JOBS = {"synth": job_synth, "convert": job_convert, "merge": job_merge, "plan": job_plan, "read": job_read,
        "embed": job_embed}


# -- the driver ---------------------------------------------------------------------------------------------------
def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tools.bench_population", "--job", *args], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parent.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(f"a benchmark job failed (exit {p.returncode}): {' '.join(map(str, p.args))}")
    return json.loads(out.strip().splitlines()[-1])


def _run(*args: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    out = _result(_start(*args))
    return {**out, "load": round(max(load, os.getloadavg()[0]), 1)}


def measure(work: Path, persons: int, tasks: int, embed_batches: int, scaling: bool = True) -> list[dict[str, Any]]:
    """Every stage at ``persons``: one row a stage (seconds, persons/s, peak RSS MiB, and what it measured); without
    ``scaling`` neither convert-2 nor the array and its merge (their ratios measured at the smaller sizes)."""
    root = work / f"p{persons}"
    subprocess.run(["rm", "-rf", str(root)], check=True)
    rows = [{"stage": "synth", **_run("synth", str(root / "raw"), str(persons))}]
    one = _run("convert", str(root / "raw"), str(root / "ds1"), "1")
    rows += [{"stage": "convert-1", **one}]
    if scaling:
        rows += _scaling(root, one, tasks)
    rows += [{"stage": "plan", **_run("plan", str(root / "ds1"))},
             {"stage": "read", **_run("read", str(root / "ds1"))},
             {"stage": "embed", **_run("embed", str(root / "ds1"), str(root / "emb"), str(embed_batches))}]
    subprocess.run(["rm", "-rf", str(root)], check=True)  # a size's files go once measured: the disk is shared
    for r in rows:
        r["population"] = persons
        r["persons_s"] = round(r["persons"] / r["seconds"])
    return rows


def _scaling(root: Path, one: dict[str, Any], tasks: int) -> list[dict[str, Any]]:
    """convert-2, the array of ``tasks`` and its merge; each conversion's fingerprint must be convert-1's."""
    rows = [{"stage": "convert-2", **_run("convert", str(root / "raw"), str(root / "ds2"), "2")}]
    wall, load = time.perf_counter(), os.getloadavg()[0]
    parts = [_result(p) for p in [_start("convert", str(root / "raw"), str(root / "dsk"), "1", str(i), str(tasks))
                                  for i in range(tasks)]]
    wall = time.perf_counter() - wall
    rows.append({"stage": f"array-{tasks}", "seconds": wall, "persons": one["persons"],
                 "task_seconds": max(p["seconds"] for p in parts), "peak_rss_mb": max(p["peak_rss_mb"] for p in parts),
                 "spill_bytes": max(p["spill_bytes"] for p in parts), "cpu_s": max(p["cpu_s"] for p in parts),
                 "encoded": max(p["encoded"] for p in parts), "load": round(max(load, os.getloadavg()[0]), 1)})
    merged = _run("merge", str(root / "dsk"))
    rows.append({"stage": "merge", **merged})
    if not one["fingerprint"] == rows[0]["fingerprint"] == merged["fingerprint"]:
        raise RuntimeError(f"{root}: the conversions differ ({one['fingerprint']}, {rows[0]['fingerprint']}, "
                           f"{merged['fingerprint']})")
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Seconds and peak RSS of each stage against the population (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for stage in dict.fromkeys(r["stage"] for r in rows if r["stage"] != "synth"):
        mine = [r for r in rows if r["stage"] == stage]
        xs = [r["population"] for r in mine]
        ax_t.plot(xs, [r["seconds"] for r in mine], "o-", label=stage)
        ax_m.plot(xs, [r["peak_rss_mb"] for r in mine], "o-", label=stage)
    for ax, what in ((ax_t, "seconds"), (ax_m, "peak RSS (MiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("persons in the population")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--persons", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    p.add_argument("--tasks", type=int, default=2, help="array tasks, run at once")
    p.add_argument("--embed-batches", type=int, default=40,
                   help="embed only this many batches of 256 (its rate; 0: everyone)")
    p.add_argument("--scaling-up-to", type=int, default=None,
                   help="above this population run neither convert-2 nor the array (default: at every size)")
    p.add_argument("--work", type=Path, default=Path("bench-population"))
    p.add_argument("--out", type=Path, default=None, help="write population.csv and population.png here")
    p.add_argument("--job", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        kind, *rest = args.job
        result = JOBS[kind](*rest)
        print(json.dumps({**result, "peak_rss_mb": round(peak_rss_mb(), 1), "cpu_s": round(cpu_seconds(), 2)}))
        return
    rows = []
    for n in args.persons:
        mine = measure(args.work, n, args.tasks, args.embed_batches, args.scaling_up_to is None
                       or n <= args.scaling_up_to)
        rows += mine
        for r in mine:
            print(json.dumps(r), flush=True)
        if args.out is not None:
            write_csv(args.out / "population.csv", rows, ["population", "stage", "seconds", "persons", "persons_s",
                                                          "cpu_s", "peak_rss_mb", "task_seconds", "encoded", "bytes",
                                                          "spill_bytes", "first_batch_s", "steady_persons_s",
                                                          "load"])
            plot(rows, args.out / "population.png")


if __name__ == "__main__":
    main()
