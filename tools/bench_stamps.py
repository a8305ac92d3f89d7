"""Stamps once per token (format 1) or once per run of tokens that share them (format 2), on the same persons.

The tokens of one event share abspos / age / segment, so format 2 stores each run of equal stamps once, with its
length (docs/results/reader.md, change 11). This script re-encodes the train blocks of a converted dataset both ways
(columnar, zstd at the dataset's level) and times, in one process,

- decompression of every block (best of 3), the reader's largest cost;
- the reader's packed collate itself (flat indices, one ``np.take`` per field into the batch buffer), for batches
  of 256 drawn from shuffled 4,096-person windows;
- the bytes a packed batch ships (through the worker's pipe, then to the device).

Usage: python -m tools.bench_stamps [DATASET]   (default: the loader bench's 200k-person dataset)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from lifeseq_shards.reader.collate import BatchSpec, collate_packed
from lifeseq_shards.store.format import (
    STAMPS,
    Block,
    Field,
    concat_blocks,
    encode_block,
    make_schema,
    to_runs,
    token_schema,
)
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks

ROOT = Path(__file__).resolve().parent.parent
WINDOW, BATCH = 4096, 256


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gather_seconds(block: Block, schema: list[Field], seed: int = 0) -> float:
    """Time of the reader's packed collate (its gathers into one buffer) over every window of ``block``: one pass,
    batches of 256 from shuffled 4,096-person windows."""
    rng = np.random.default_rng(seed)
    spec = BatchSpec(schema, packed=True)
    t0 = time.perf_counter()
    for lo in range(0, block.n, WINDOW):
        order = lo + rng.permutation(min(WINDOW, block.n - lo))
        for i in range(0, len(order), BATCH):
            collate_packed(block, spec, order[i : i + BATCH])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", type=Path, nargs="?", default=ROOT / "bench-data" / "p200000" / "ours")
    args = ap.parse_args()
    m = read_manifest(args.dataset)
    schema = list(m.schema)
    if m.offline_mlm:
        raise SystemExit(f"{args.dataset}: an offline-MLM dataset; this comparison takes a plain one")
    dtypes = {f.name: f.dtype for f in schema}
    per_run = make_schema(dtypes["tokens"], {name: dtypes[name] for name in STAMPS})
    level = int((m.params or {}).get("zstd_level", 9))
    compress = zstandard.ZstdCompressor(level=level, write_checksum=True).compress
    blocks = [b for e in m.splits["train"].shards for b in read_shard_blocks(args.dataset / e.file, schema)]
    per_token = token_schema(schema)
    token_blocks = [Block({f.name: b.columns[f.name] for f in per_token}) for b in blocks]
    run_blocks = [to_runs(b, per_run) for b in blocks]
    persons = sum(b.n for b in blocks)
    tokens = sum(len(b.columns["tokens"]) for b in blocks)
    runs = sum(len(r.columns["run_length"]) for r in run_blocks)
    print(f"{args.dataset}: {persons:,} persons, {tokens / persons:.1f} tokens and {runs / persons:.1f} runs a person "
          f"({tokens / runs:.2f} tokens a run)")
    d = zstandard.ZstdDecompressor()
    rows = []
    for name, fields, encoded in (("per token (format 1)", per_token, token_blocks),
                                  ("per run (format 2)", per_run, run_blocks)):
        payloads = [encode_block(b, fields) for b in encoded]
        frames = [compress(p) for p in payloads]
        secs = best_of(3, lambda frames=frames: [d.decompress(f) for f in frames])
        whole = concat_blocks(encoded, fields)
        gather = min(gather_seconds(whole, fields) for _ in range(3))
        shipped = sum(v.nbytes for v in whole.columns.values())  # the packed batch holds every column once
        rows.append((name, sum(map(len, frames)) / persons, sum(map(len, payloads)) / persons, persons / secs,
                     persons / gather, shipped / persons))
    print("\n| stamps | zstd B/person | decoded B/person | decompress persons/s | gathers persons/s | "
          "packed B/person |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, disk, dec, dps, gps, ship in rows:
        print(f"| {name} | {disk:,.1f} | {dec:,.1f} | {dps:,.0f} | {gps:,.0f} | {ship:,.1f} |")
    (_, disk0, dec0, dps0, gps0, ship0), (_, disk1, dec1, dps1, gps1, ship1) = rows
    print(f"\nper run / per token: zstd bytes {disk1 / disk0:.2f}x, decoded bytes {dec1 / dec0:.2f}x, decompress speed "
          f"{dps1 / dps0:.2f}x, gather speed {gps1 / gps0:.2f}x, packed bytes {ship1 / ship0:.2f}x")


if __name__ == "__main__":
    main()
