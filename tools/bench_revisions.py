"""The loader benchmark on an older revision and on the working tree, alternating, in one run: did a change move the
reader's ratios?

Each round runs ``tools/bench_loader`` (the contenders named by ``--only``) in a checkout of ``--old``, then in this
working tree, on the same converted data (``--work``; with ``--work-per-revision``, each revision's own conversion of
the same persons, for a change of the format version that the other revision does not read). This machine is shared
and noisy, so the verdict is read from neighbouring runs: each run's own ratio bars (computed by this tree's
``tools.common.bars``), and per contender the working tree's rate over the old revision's in the same round. With
``--cpu-pairs N``, then N pairs of one in-process pass each (packed batches of 256), old and new in turn: the
process's CPU time of its fastest of ``--passes`` passes, which the machine's other jobs disturb less than the
loader bench's wall-clock rates.

Usage: python -m tools.bench_revisions --old 6f64ed9 [--rounds 2] [--people 200000] [--only ours-w1 ...]
       [--cpu-pairs 8 [--passes 6]]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tools.common import bars, write_csv

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONTENDERS = ("ours-w0", "ours-w1", "ours-w2", "seed-mem", "zstd-limit")
# one in-process pass's CPU time, run in each checkout; an old revision may predate World (rank= / world_size=)
CPU_PASS = """
import sys, time
from lifeseq_shards.reader import ShardedDataset, ShardedLoader
try:
    from lifeseq_shards.reader import World
    world = {"world": World(0, 1)}
except ImportError:
    world = {"rank": 0, "world_size": 1}
loader = ShardedLoader(ShardedDataset(sys.argv[1], split="train", batch_size=256, num_workers=0, packed=True, **world))
times = []
for epoch in range(int(sys.argv[2]) + 1):
    loader.set_epoch(epoch)
    start = time.process_time()
    for _ in loader:
        pass
    times.append(time.process_time() - start)
print(min(times[1:]))
"""


def bench_command(checkout: Path) -> list[str]:
    """How ``checkout`` runs its loader benchmark: as a module where tools/ is a package, else as a script."""
    if (checkout / "tools" / "__init__.py").exists():
        return [sys.executable, "-m", "tools.bench_loader"]
    return [sys.executable, str(checkout / "tools" / "bench_loader.py")]


def run_bench(checkout: Path, out: Path, work: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One benchmark run of ``checkout``'s reader on the data in ``work``: its loader.csv rows by contender (errors
    left out)."""
    cmd = [*bench_command(checkout), "--people", str(args.people), "--work", str(work.resolve()),
           "--out", str(out), "--max-seconds", str(args.max_seconds), "--min-seconds", str(args.min_seconds),
           "--only", *args.only]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{checkout}: bench_loader exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    with open(out / "loader.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if not r["error"]]
    numeric = ("persons_per_s", "tokens_per_s", "disk_bytes_per_person", "h2d_bytes_per_person", "first_batch_s")
    return {r["contender"]: {k: float(v) if k in numeric and v else v for k, v in r.items()} for r in rows}


def cpu_pass(checkout: Path, data: Path, passes: int) -> float:
    """The CPU seconds of ``checkout``'s fastest in-process pass over ``data``'s train split, of ``passes`` (after
    one to warm up)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", CPU_PASS, str(data), str(passes)], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{checkout}: the CPU pass exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.split()[-1])


def cpu_pairs(old: Path, data: dict[str, Path], pairs: int, passes: int) -> list[dict[str, Any]]:
    """``pairs`` alternating old / new CPU passes (each over its ``data``), and the ratio of each pair."""
    rows = []
    for pair in tqdm(range(pairs), desc="cpu pairs", unit="pair"):
        old_s, new_s = cpu_pass(old, data["old"], passes), cpu_pass(ROOT, data["new"], passes)
        rows.append({"pair": pair, "old_cpu_s": old_s, "new_cpu_s": new_s, "new_over_old": new_s / old_s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--people", type=int, default=200_000)
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data")
    ap.add_argument("--work-per-revision", action="store_true",
                    help="each revision converts the persons into its own WORK/old, WORK/new (a format change)")
    ap.add_argument("--max-seconds", type=float, default=30.0)
    ap.add_argument("--min-seconds", type=float, default=8.0)
    ap.add_argument("--only", nargs="*", default=list(DEFAULT_CONTENDERS))
    ap.add_argument("--out", type=Path, help="write revisions.csv (and cpu.csv) here")
    ap.add_argument("--cpu-pairs", type=int, default=0, help="then this many old / new in-process CPU pairs")
    ap.add_argument("--passes", type=int, default=6, help="passes per CPU measurement (its fastest counts)")
    args = ap.parse_args()
    cpu: list[dict[str, Any]] = []
    results: list[tuple[int, str, dict[str, dict[str, Any]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs = [(r, name, tree) for r in range(args.rounds) for name, tree in (("old", old), ("new", ROOT))]
            for r, name, tree in tqdm(runs, desc="bench runs", unit="run"):
                work = args.work / name if args.work_per_revision else args.work
                results.append((r, name, run_bench(tree, Path(tmp) / f"{name}-{r}", work, args)))
            if args.cpu_pairs:  # the loader bench's conversion of the persons (bench_loader's WORK/p<people>/ours)
                data = {name: (args.work / name if args.work_per_revision else args.work) / f"p{args.people}" / "ours"
                        for name in ("old", "new")}
                cpu = cpu_pairs(old, data, args.cpu_pairs, args.passes)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    if results:
        report(results, args)
    if cpu:
        print("\nin-process pass, CPU s new / old, pair by pair: "
              + ", ".join(f"{row['new_over_old']:.3f}" for row in cpu))
        if args.out:
            write_csv(args.out / "cpu.csv", cpu)


def report(results: list[tuple[int, str, dict[str, dict[str, Any]]]], args: argparse.Namespace) -> None:
    print(f"\n{args.old} (old) against the working tree (new), {args.rounds} rounds, {args.people} persons\n")
    print("| bar | " + " | ".join(f"{name} {r}" for r, name, _ in results) + " |")
    print("| --- |" + " ---: |" * len(results))
    table = [[claim] for claim, *_ in bars(results[0][2])]
    for _, _, rows in results:
        for line, (_, value, _, _) in zip(table, bars(rows), strict=True):
            line.append("" if value is None else f"{value:.3f}")
    for line in table:
        print("| " + " | ".join(line) + " |")
    print("\n| contender: persons/s new / old, same round | " + " | ".join(f"round {r}" for r in range(args.rounds))
          + " |")
    print("| --- |" + " ---: |" * args.rounds)
    by = {(r, name): rows for r, name, rows in results}
    out_rows = []
    for contender in args.only:
        cells = []
        for r in range(args.rounds):
            old, new = by[(r, "old")].get(contender), by[(r, "new")].get(contender)
            value = new["persons_per_s"] / old["persons_per_s"] if old and new else None
            cells.append("" if value is None else f"{value:.3f}")
            out_rows.append({"contender": contender, "round": r, "new_over_old": value,
                             "old_persons_per_s": old and old["persons_per_s"],
                             "new_persons_per_s": new and new["persons_per_s"]})
        print(f"| {contender} | " + " | ".join(cells) + " |")
    if args.out:
        write_csv(args.out / "revisions.csv", out_rows)
        print(f"wrote {args.out / 'revisions.csv'}")


if __name__ == "__main__":
    main()
