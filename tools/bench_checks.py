"""What the reader's read-time checks cost: every block's checksum (format 4) against format 3's checks (the first
block's checksum, the schema tag) and against none, alternating in one process on the same shards.

Three measures, each variant in turn, round after round (this machine is shared and noisy: compare neighbours):
- the check alone: ``ShardFile.check_member`` on a shard's second member, the fastest of 5 x 20,000 calls;
- per shard: ``read_segment`` of the whole shard, its fastest of ``--repeats`` reads per variant;
- whole passes: one in-process epoch of ``ShardedDataset`` (packed batches of 256), persons per CPU-second of the
  process per variant (CPU time, which the machine's other jobs disturb less than wall time).

Usage: python -m tools.bench_checks DATASET [DATASET ...] [--repeats 30] [--passes 5] [--out docs/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lifeseq_shards import ShardedDataset
from lifeseq_shards.device.build import packed_views
from lifeseq_shards.plan.slots import Segment
from lifeseq_shards.reader import World, read_segment
from lifeseq_shards.store.shardfile import ShardFile, iter_tar_members
from tools.tables import write_csv

# variant -> the shard as the reader checks it
VARIANTS: dict[str, Callable[[ShardFile], ShardFile]] = {
    "every block (format 4)": lambda s: s,
    "first block + tag (format 3)": lambda s: dataclasses.replace(s, block_checksums=None),
    "none": lambda s: dataclasses.replace(s, block_checksums=None, head_checksum=None, tag=None),
}


def rotated(r: int) -> list[str]:
    """The variants in round ``r``'s order: each goes first in every third round."""
    names = list(VARIANTS)
    return names[r % len(names):] + names[: r % len(names)]


def check_alone(shard: ShardFile) -> dict[str, float]:
    """Seconds a ``check_member`` call of member 1 (member 0 where the shard has one block) takes, per variant."""
    with open(shard.url, "rb") as fh:
        members = list(iter_tar_members(fh))[:2]
    i = len(members) - 1
    name, data = members[i]
    out = {}
    for v in rotated(0):
        call = functools.partial(VARIANTS[v](shard).check_member, i, name, data)
        out[v] = min(timeit.repeat(call, number=20_000, repeat=5)) / 20_000
    return out


def whole_shards(ds: ShardedDataset) -> list[ShardFile]:
    """The split's equal shards, without its remainder shard (whose few blocks would skew the per-block figures)."""
    return ds.shards[: len(ds.sizes)]


def per_shard(ds: ShardedDataset, repeats: int) -> dict[str, np.ndarray]:
    """Each shard's fastest whole read per variant, in seconds (the variants alternate read by read)."""
    best = {v: np.full(len(whole_shards(ds)), np.inf) for v in VARIANTS}
    for r in tqdm(range(repeats), desc="per shard", unit="round"):
        for i, shard in enumerate(whole_shards(ds)):
            for v in rotated(r):  # the first read of a shard finds colder caches than the next two
                checked = VARIANTS[v](shard)
                t = time.perf_counter()
                read_segment(Segment(checked, 0, shard.samples), ds.schema)
                best[v][i] = min(best[v][i], time.perf_counter() - t)
    return best


def passes(root: str, rounds: int) -> dict[str, list[float]]:
    """Persons per CPU-second of whole in-process epochs, the variants in turn each round."""
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in tqdm(range(rounds), desc="passes", unit="round"):
        for v in rotated(r):
            ds = ShardedDataset(root, "train", batch_size=256, world=World(0, 1), packed=True)
            ds.shards = [VARIANTS[v](s) for s in ds.shards]
            t = time.process_time()
            n = sum(len(packed_views(b)["person_id"]) for b in ds)
            rates[v].append(n / (time.process_time() - t))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("datasets", nargs="+")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write checks.csv here")
    args = ap.parse_args()
    rows = []
    for root in args.datasets:
        ds = ShardedDataset(root, "train", batch_size=256, world=World(0, 1))
        alone = check_alone(ds.shards[0])
        best = per_shard(ds, args.repeats)
        rates = passes(root, args.passes)
        base = best["none"]
        whole = whole_shards(ds)
        blocks = np.array([s.blocks for s in whole])
        print(f"\n{root}: {len(whole)} train shards of {ds.shards[0].samples} persons, {int(blocks.mean())} "
              f"blocks each; per shard the fastest of {args.repeats} reads, then {args.passes} passes a variant")
        print(f"{'checks':30s} {'ns a check':>10s} {'us a shard':>11s} {'vs none':>8s} {'us a block':>11s} "
              f"{'persons/CPU-s':>13s} {'vs none':>8s}")
        for v in VARIANTS:
            extra = (best[v] - base) / blocks * 1e6
            rate = float(np.median(rates[v]))
            ratio = float(np.median(np.array(rates[v]) / np.array(rates["none"])))
            print(f"{v:30s} {alone[v] * 1e9:10.0f} {np.median(best[v]) * 1e6:11.1f} {np.median(best[v] / base):8.3f} "
                  f"{np.median(extra):+11.2f} {rate:13,.0f} {ratio:8.3f}")
            rows.append({"dataset": root, "checks": v, "shards": len(whole),
                         "blocks_per_shard": int(blocks.mean()), "check_member_ns": round(alone[v] * 1e9),
                         "median_shard_us": round(float(np.median(best[v])) * 1e6, 1),
                         "shard_ratio_vs_none": round(float(np.median(best[v] / base)), 4),
                         "extra_us_per_block": round(float(np.median(extra)), 3),
                         "pass_persons_per_cpu_s": round(rate), "pass_ratio_vs_none": round(ratio, 4)})
    if args.out:
        write_csv(args.out / "checks.csv", rows)


if __name__ == "__main__":
    main()
