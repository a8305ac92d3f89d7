"""How long a loader's workers take to start when the training script imports Lightning at its top, as the
researchers' pretrain.py (``pytorch_lightning``) and the plain-loop guide's script (through
``lifeseq_shards.model``) do: the time from a new loader to its first batch, pass after pass (each pass a new
loader, whose workers start again, as the plain loop's validations do), and the script's whole run, from its start
to its exit.

Workers start from a forkserver, and each runs the main script again (its ``__mp_main__``). Two forkservers, in
alternating runs of the same script on the same data: ``preloaded`` is the loader's own (the server imports the
script's top-level imports once, ``mainguard.main_imports``); ``each worker`` is a forkserver that preloads torch,
webdataset and the reader only, as the loader's did before, so that every worker imports Lightning itself. Ratios
are measured in one run: ``python -m tools.bench_worker_start``."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population

SCRIPT = '''import multiprocessing
import sys
import time

import {flavour}  # the researchers' pretrain.py imports it at its top

from lifeseq_shards import ShardedDataset, ShardedLoader
from lifeseq_shards.reader import World
from lifeseq_shards.reader.transport import PRELOAD

if __name__ == "__main__":
    root, how, workers, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ctx = None  # the loader's own forkserver
    if how == "each worker":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # the loader's before: not the script's imports
    ds = ShardedDataset(root, split="train", batch_size=64, num_workers=workers, world=World(0, 1))
    for _ in range(passes):
        start = time.perf_counter()
        batches = iter(ShardedLoader(ds, multiprocessing_context=ctx))
        next(batches)
        print("first", time.perf_counter() - start, flush=True)
        sum(1 for _ in batches)
'''
HOWS = ("preloaded", "each worker")


def run(script: Path, root: Path, how: str, workers: int, passes: int) -> tuple[list[float], float]:
    """(each pass's seconds to its first batch, the script's seconds from start to exit)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), str(root), how, str(workers), str(passes)], cwd=script.parent,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [float(line.split()[1]) for line in out if line.startswith("first ")], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each forkserver")
    p.add_argument("--flavour", default="lightning", choices=("lightning", "pytorch_lightning"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw, root, script = Path(tmp) / "raw", Path(tmp) / "ds", Path(tmp) / "train.py"
        synth_population(raw, 2000, seed=0, progress=False)
        convert_dataset([str(raw / "sequences.parquet")], root, vocab=str(raw / "vocab.csv"),
                        opts=ConvertOptions(progress=False, shards=4, num_val=100))
        script.write_text(SCRIPT.format(flavour=args.flavour))
        got: dict[str, tuple[list[float], list[float]]] = {how: ([], []) for how in HOWS}
        for _ in range(args.rounds):
            for how in HOWS:
                firsts, whole = run(script, root, how, args.workers, args.passes)
                got[how][0].extend(firsts)
                got[how][1].append(whole)
    print(f"{args.workers} workers, {args.passes} passes a run, {args.rounds} runs each, the script imports "
          f"{args.flavour}")
    print("| forkserver | first batch of a pass, median s | a run, median s |")
    print("| --- | --- | --- |")
    medians = {how: (statistics.median(f), statistics.median(w)) for how, (f, w) in got.items()}
    for how, (first, whole) in medians.items():
        print(f"| {how} | {first:.2f} | {whole:.2f} |")
    before, after = medians["each worker"], medians["preloaded"]
    print(f"each worker / preloaded: first batch {before[0] / after[0]:.1f}x, run {before[1] / after[1]:.1f}x")


if __name__ == "__main__":
    main()
