"""Reader throughput with a token budget against batches of persons: rank 0's loader of an R-rank arrangement reads a
whole epoch both ways, alternating, on the same dataset (persons/s of that rank; the loader's CPU cost, as a
GPU's data path pays it). The two loaders stay up (persistent workers) and take turns an epoch at a time, the order
swapped each round; the ratio is the median of the rounds' paired ratios (each pair ran back to back, so a slow
spell of a shared machine falls on both), with its quartiles. Writes <out>/token-reader.csv and prints the table
for docs/results/balance-reader.md.

    python -m tools.bench_token_reader --out docs/results --synth 100000 --ranks 2 4 8 --workers 0 2 --rounds 15
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


def warm_loader(root: Path, ranks: int, workers: int, batch: int, budget: int | None) -> ShardedLoader:
    """Rank 0's loader of an R-rank arrangement, packed batches (the padding-free layout's), after an untimed epoch 0
    that starts its (persistent) workers, as in training."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-balance warning of arrangements that do not divide
        ds = ShardedDataset(root, split="train", batch_size=batch, world=World(0, ranks), num_workers=workers,
                            packed=True, tokens_per_batch=budget)
    loader = ShardedLoader(ds)
    loader.set_epoch(0)
    for _ in loader:
        pass
    return loader


def epoch_rate(loader: ShardedLoader, epoch: int) -> tuple[float, int]:
    """(persons/s, persons) of ``loader``'s whole epoch ``epoch``: each worker plans the new epoch inside it, as in
    training, so the planning is timed."""
    loader.set_epoch(epoch)
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
    p.add_argument("--rounds", type=int, default=15, help="epochs timed of each mode, alternating")
    args = p.parse_args()
    root = args.data or synth_dataset(args.out / "token-reader-data", args.synth, seed=0)
    lengths, _ = split_lengths(str(root), read_manifest(root), "train")
    budget = int(args.batch * lengths.mean())
    rows = []
    for ranks in args.ranks:
        for workers in args.workers:
            loaders = {"persons": warm_loader(root, ranks, workers, args.batch, None),
                       "tokens": warm_loader(root, ranks, workers, args.batch, budget)}
            rates: dict[str, list[float]] = {"persons": [], "tokens": []}
            for rnd in range(1, args.rounds + 1):  # alternating, so a slow spell of the machine hits both
                for mode in ("persons", "tokens")[:: 1 if rnd % 2 else -1]:
                    rates[mode].append(epoch_rate(loaders[mode], rnd)[0])
            del loaders  # their workers end
            # each round's two epochs ran back to back: their ratio is paired, free of the machine's slower spells
            paired = np.array(rates["tokens"]) / np.array(rates["persons"])
            rows.append({"ranks": ranks, "workers": workers, "batch_persons": args.batch, "budget": budget,
                         "persons_per_s_persons_plan": round(float(np.median(rates["persons"]))),
                         "persons_per_s_token_plan": round(float(np.median(rates["tokens"]))),
                         "token_over_persons": round(float(np.median(paired)), 3),
                         "ratio_q25": round(float(np.quantile(paired, 0.25)), 3),
                         "ratio_q75": round(float(np.quantile(paired, 0.75)), 3)})
            print(rows[-1], flush=True)
    write_csv(args.out / "token-reader.csv", rows)
    print("\n| ranks | workers | persons plan (persons/s) | token plan (persons/s) | token / persons (quartiles) |"
          "\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['workers']} | {r['persons_per_s_persons_plan']:,} | "
              f"{r['persons_per_s_token_plan']:,} | {r['token_over_persons']} ({r['ratio_q25']}-{r['ratio_q75']}) |")


if __name__ == "__main__":
    main()
