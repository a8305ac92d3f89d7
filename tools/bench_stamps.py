"""Stamps once per token (format 1) or once per run of tokens that share them (format 2), on the same persons.

The tokens of one event share abspos / age / segment, so format 2 stores each run of equal stamps once, with its
length (docs/performance.md, change 11). This script re-encodes the train blocks of a converted dataset both ways
(columnar, zstd at the dataset's level) and times, in one process,

- decompression of every block (best of 3), the reader's largest cost;
- the per-batch gathers of the reader's packed collate: flat indices + one ``np.take`` per ragged field, for
  batches of 256 drawn from shuffled 4,096-person windows (per token: 4 fields; per run: tokens per token, then
  run length and 3 stamps per run);
- the bytes a packed batch ships (through the worker's pipe, then to the device).

Usage: python tools/bench_stamps.py [DATASET]   (default: the loader bench's 200k-person dataset)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from lifeseq_shards.format import (
    RAGGED,
    STAMPS,
    make_schema,
    read_manifest,
    read_shard_blocks,
    schema_from_json,
    to_runs,
    token_schema,
)

ROOT = Path(__file__).resolve().parent.parent
WINDOW, BATCH = 4096, 256


def raw(columns: dict[str, np.ndarray]) -> bytes:
    """Columns back to back, 8-byte aligned (the block codec's layout, without its header)."""
    parts = []
    for col in columns.values():
        data = np.ascontiguousarray(col).tobytes()
        parts += [data, b"\0" * (-len(data) % 8)]
    return b"".join(parts)


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def flat_index(offsets: np.ndarray, index: np.ndarray) -> np.ndarray:
    starts, lens = offsets[index], offsets[index + 1] - offsets[index]
    cum = np.zeros(len(index), dtype=np.int64)
    np.cumsum(lens[:-1], out=cum[1:])
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - cum, lens)


def gather_seconds(cols: dict[str, np.ndarray], per_run: bool, seed: int = 0) -> float:
    """Time of the packed collate's gathers over every window of ``cols`` (one pass, shuffled windows)."""
    rng = np.random.default_rng(seed)
    n = len(cols["person_id"])
    tok_offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(cols["length"], out=tok_offs[1:])
    run_offs = np.zeros(n + 1, dtype=np.int64)
    if per_run:
        np.cumsum(cols["n_runs"], out=run_offs[1:])
    t0 = time.perf_counter()
    for lo in range(0, n, WINDOW):
        order = lo + rng.permutation(min(WINDOW, n - lo))
        for i in range(0, len(order), BATCH):
            idx = order[i : i + BATCH]
            cols["person_id"].take(idx)
            cols["length"].take(idx)
            flat = flat_index(tok_offs, idx)
            if per_run:
                cols["tokens"].take(flat)
                cols["n_runs"].take(idx)
                flat = flat_index(run_offs, idx)
                for f in ("run_length", *STAMPS):
                    cols[f].take(flat)
            else:
                for f in ("tokens", *STAMPS):
                    cols[f].take(flat)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", type=Path, nargs="?", default=ROOT / "bench-data" / "p200000" / "ours")
    args = ap.parse_args()
    m = read_manifest(args.dataset)
    schema = schema_from_json(m["schema"])
    if any(f.kind == RAGGED and f.name == "masked_tokens" for f in schema):
        raise SystemExit(f"{args.dataset}: an offline-MLM dataset; this comparison takes a plain one")
    dtypes = {f.name: f.dtype for f in schema}
    per_run = make_schema(dtypes["tokens"], {name: dtypes[name] for name in STAMPS})
    level = int(m["params"].get("zstd_level", 9))
    compress = zstandard.ZstdCompressor(level=level, write_checksum=True).compress
    blocks = [b for e in m["splits"]["train"]["shards"] for b in read_shard_blocks(args.dataset / e["file"], schema)]
    token_cols = [{f.name: b.columns[f.name] for f in token_schema(schema)} for b in blocks]
    run_cols = [to_runs(b, per_run).columns for b in blocks]
    persons = sum(b.n for b in blocks)
    tokens = sum(len(b.columns["tokens"]) for b in blocks)
    runs = sum(len(r["run_length"]) for r in run_cols)
    print(f"{args.dataset}: {persons:,} persons, {tokens / persons:.1f} tokens and {runs / persons:.1f} runs a person "
          f"({tokens / runs:.2f} tokens a run)")
    d = zstandard.ZstdDecompressor()
    rows = []
    for name, per_run, cols in (("per token (format 1)", False, token_cols), ("per run (format 2)", True, run_cols)):
        frames = [compress(raw(c)) for c in cols]
        decoded = sum(len(raw(c)) for c in cols)
        secs = best_of(3, lambda frames=frames: [d.decompress(f) for f in frames])
        whole = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
        gather = min(gather_seconds(whole, per_run) for _ in range(3))
        shipped = sum(v.nbytes for k, v in whole.items())  # the packed batch holds every column once
        rows.append((name, sum(map(len, frames)) / persons, decoded / persons, persons / secs, persons / gather,
                     shipped / persons))
    print("\n| stamps | zstd B/person | decoded B/person | decompress persons/s | gathers persons/s | "
          "packed B/person |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, disk, dec, dps, gps, ship in rows:
        print(f"| {name} | {disk:,.1f} | {dec:,.1f} | {dps:,.0f} | {gps:,.0f} | {ship:,.1f} |")
    (_, disk0, dec0, dps0, gps0, ship0), (_, disk1, dec1, dps1, gps1, ship1) = rows
    print(f"\nper run / per token: zstd bytes {disk1 / disk0:.2f}x, decoded bytes {dec1 / dec0:.2f}x, decompress speed "
          f"{dps1 / dps0:.2f}x, gather speed {gps1 / gps0:.2f}x, packed bytes {ship1 / ship0:.2f}x")


if __name__ == "__main__":
    main()
