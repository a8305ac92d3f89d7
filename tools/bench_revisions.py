"""The loader benchmark on an older revision and on the working tree, alternating, in one run: did a change move the
reader's ratios?

Each round runs ``tools/bench_loader`` (the contenders named by ``--only``) in a checkout of ``--old``, then in this
working tree, on the same converted data (``--work``; with ``--work-per-revision``, each revision's own conversion of
the same persons, for a change of the format version that the other revision does not read). This machine is shared
and noisy, so the verdict is read from neighbouring runs: each run's own ratio bars (computed by this tree's
``bench_loader.bars``), and per contender the working tree's rate over the old revision's in the same round.

Usage: python -m tools.bench_revisions --old 6f64ed9 [--rounds 2] [--people 200000] [--only ours-w1 ...]
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

from tools.bench_loader import bars
from tools.tables import write_csv

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONTENDERS = ("ours-w0", "ours-w1", "ours-w2", "seed-mem", "zstd-limit")


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
    ap.add_argument("--out", type=Path, help="write revisions.csv here")
    args = ap.parse_args()
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
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    report(results, args)


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
