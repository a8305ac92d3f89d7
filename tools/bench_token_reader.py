"""Reader throughput with a token budget against batches of persons: rank 0's loader of an R-rank layout reads a
whole epoch both ways, alternating, on the same dataset (persons/s of that rank; the loader's CPU cost, as a
GPU's data path pays it). Writes <out>/token-reader.csv and prints the table for docs/results/balance-reader.md.

    python -m tools.bench_token_reader --out docs/results --synth 100000 --ranks 2 4 8 --workers 0 2 --rounds 3
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np

from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest
from tools.common import synth_dataset, write_csv


def epoch_rate(root: Path, ranks: int, workers: int, batch: int, budget: int | None, epoch: int) -> tuple[float, int]:
    """(persons/s, persons) of rank 0's whole epoch ``epoch`` + 1, packed batches (the padding-free layout's), after
    an untimed epoch that starts the (persistent) workers, as in training."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-balance warning of layouts that do not divide
        ds = ShardedDataset(root, "train", batch, world=World(0, ranks), num_workers=workers, packed=True,
                            tokens_per_batch=budget)
    loader = ShardedLoader(ds)
    loader.set_epoch(epoch)
    for _ in loader:
        pass
    loader.set_epoch(epoch + 1)  # each worker plans the new epoch, as in training: timed
    start, persons = time.perf_counter(), 0
    for b in loader:
        persons += b.counts[0]  # the first column is a person's scalar: one value a person
    return persons / (time.perf_counter() - start), persons


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, help="a converted dataset (default: a synth conversion of --synth persons)")
    p.add_argument("--synth", type=int, default=100_000)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batch", type=int, default=64, help="persons a batch; the budget is as many mean persons")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    root = args.data or synth_dataset(args.out / "token-reader-data", args.synth, seed=0)
    lengths, _ = split_lengths(str(root), read_manifest(root), "train")
    budget = int(args.batch * lengths.mean())
    rows = []
    for ranks in args.ranks:
        for workers in args.workers:
            rates: dict[str, list[float]] = {"persons": [], "tokens": []}
            for rnd in range(args.rounds):  # alternating, so a slow spell of the machine hits both
                for mode, b in (("persons", None), ("tokens", budget))[:: 1 if rnd % 2 == 0 else -1]:
                    rates[mode].append(epoch_rate(root, ranks, workers, args.batch, b, rnd)[0])
            old, new = float(np.median(rates["persons"])), float(np.median(rates["tokens"]))
            rows.append({"ranks": ranks, "workers": workers, "batch_persons": args.batch, "budget": budget,
                         "persons_per_s_persons_plan": round(old), "persons_per_s_token_plan": round(new),
                         "token_over_persons": round(new / old, 3)})
            print(rows[-1], flush=True)
    write_csv(args.out / "token-reader.csv", rows)
    print("\n| ranks | workers | persons plan (persons/s) | token plan (persons/s) | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['workers']} | {r['persons_per_s_persons_plan']:,} | "
              f"{r['persons_per_s_token_plan']:,} | {r['token_over_persons']} |")


if __name__ == "__main__":
    main()
