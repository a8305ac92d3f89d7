"""Conversion benchmark: persons/s of `convert` from parquet and from the seed's encoded.h5, and bytes per person
against the seed's gzip HDF5 for the same persons. One run, one population; ratios are what to compare.

Usage: python -m tools.bench_convert [--people 50000] [--processes 1 2] [--work bench-data/convert] [--out docs/results]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.store.manifest import Manifest
from tools.common import read_persons, write_csv, write_seed_h5


def timed_convert(inputs: list[str], out: Path, vocab: str | None, processes: int) -> tuple[float, Manifest]:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    m = convert_dataset(inputs, out, vocab, ConvertOptions(processes=processes, val_fraction=0.0, progress=False))
    return time.perf_counter() - t, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--people", type=int, default=50_000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", type=Path, default=Path("bench-data/convert"))
    ap.add_argument("--out", type=Path, default=None, help="write convert.csv here")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    raw = work / "raw"
    if not (raw / "sequences.parquet").exists():
        synth_population(raw, args.people, seed=0)
    pq, vocab = str(raw / "sequences.parquet"), str(raw / "vocab.csv")
    rows = []
    for p in args.processes:
        secs, m = timed_convert([pq], work / f"from-parquet-{p}", vocab, p)
        rows.append({"input": "parquet", "processes": p, "persons": m.totals.persons, "seconds": secs,
                     "bytes": m.totals.bytes})
    # the same persons in the seed's step-5 layout (int64, padded to 512, gzip level 4, chunks of 64 rows)
    ours = work / f"from-parquet-{args.processes[0]}"
    h5 = work / "encoded.h5"
    if not h5.exists():
        write_seed_h5(h5, read_persons(ours), gzip=True)
    for p in args.processes:
        secs, m = timed_convert([str(h5)], work / f"from-h5-{p}", None, p)
        rows.append({"input": "hdf5", "processes": p, "persons": m.totals.persons, "seconds": secs,
                     "bytes": m.totals.bytes})
    # bytes per person of the very persons the h5 holds: the h5 was written from the parquet dataset's train shards
    h5_persons = rows[-1]["persons"]
    h5_bytes = h5.stat().st_size / h5_persons
    print(f"\n{args.people:,} synthetic persons; seed gzip HDF5: {h5_bytes:,.0f} bytes/person ({h5_persons:,} persons)")
    print(f"{'input':8s} {'proc':>4s} {'persons':>9s} {'seconds':>8s} {'persons/s':>10s} {'bytes/person':>13s} "
          f"{'vs gzip h5':>10s}")
    for r in rows:
        r["persons_per_s"] = r["persons"] / r["seconds"]
        r["bytes_per_person"] = r["bytes"] / r["persons"]
        r["ratio_to_gzip_h5"] = r["bytes_per_person"] / h5_bytes
        print(f"{r['input']:8s} {r['processes']:4d} {r['persons']:9,d} {r['seconds']:8.1f} {r['persons_per_s']:10,.0f}"
              f" {r['bytes_per_person']:13,.0f} {r['ratio_to_gzip_h5']:10.2f}")
    ok = all(r["ratio_to_gzip_h5"] <= 0.5 for r in rows)
    print(f"bytes on disk <= 0.5x the seed's gzip HDF5: {'PASS' if ok else 'FAIL'}")
    if args.out:
        write_csv(args.out / "convert.csv", rows)


if __name__ == "__main__":
    main()
