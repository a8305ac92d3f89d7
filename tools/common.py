"""What more than one tool uses; a tool imports this module and no other tool. CSV rows in one format, the sample's
lengths and the shards the balance benches lay them in, the synthetic dataset the training benches run on, the
loader bench's train persons read back and written as the seed's encoded.h5, and the loader bench's bars (which
tools/bench_revisions.py judges each of its runs by)."""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.store.format import Block, concat_blocks, token_schema
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks

SEQ = 512  # the seed's width
NARROW = {"tokens": np.uint16, "abspos": np.int16, "age": np.uint8, "segment": np.uint8}
RIVALS = ("seed-h5", "seed-mem", "webdataset", "litdata")  # the loader bench's contenders 2-5
SHARD = 1024  # persons a shard in the balance benches: the converter's default least (MIN_SHARD_PERSONS)
REPO = Path(__file__).resolve().parents[1]


def write_csv(path: Path, rows: Sequence[dict[str, Any]], fieldnames: Sequence[str] | None = None) -> None:
    """``rows`` into ``path`` (its folder made): the columns are ``fieldnames``, else every key in order of first
    appearance; a missing value is written empty and a key outside the columns is left out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = list(fieldnames) if fieldnames is not None else list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def commit() -> str:
    """The repository's HEAD, short: what a results page names as the commit it measured."""
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def sample_lengths(sample: Path) -> np.ndarray:
    """Real tokens of each person of the sample's encoded_nomlm.h5 (its padding mask's sum), in file order."""
    with h5py.File(sample / "encoded_nomlm.h5", "r") as f:
        return f["padding_mask"][()].sum(axis=1).astype(np.int64)


def shards_of(n: int) -> list[int]:
    """Shard sizes of ``n`` persons in shards of :data:`SHARD`, the rest a remainder shard (last)."""
    return [SHARD] * (n // SHARD) + [n % SHARD]


def synth_dataset(root: Path, people: int, seed: int, max_seq_len: int = 512) -> Path:
    """`shardify synth` + `shardify convert --max-seq-len` into root/shards (kept: a second run with the same --out
    reuses it)."""
    shards = root / "shards"
    if (shards / "manifest.json").exists():
        return shards
    raw = root / "raw"
    synth_population(raw, people, seed, progress=False)
    convert_dataset([str(raw / "sequences.parquet")], shards, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(seed=seed, overwrite=True, progress=False, max_seq_len=max_seq_len))
    return shards


def train_shards(ours: Path) -> list[Path]:
    """The train split's files, the remainder shard last (training reads it too)."""
    return [ours / e.file for e in read_manifest(ours).splits["train"].entries()]


def read_persons(ours: Path) -> Block:
    """The train persons, remainder included, in shard order."""
    schema = read_manifest(ours).schema
    blocks = [b for path in train_shards(ours) for b in read_shard_blocks(path, schema)]
    return concat_blocks(blocks, token_schema(schema))


def seed_rows(block: Block, start: int, stop: int, width: int = SEQ) -> dict[str, np.ndarray]:
    """Persons [start, stop) in the seed's encoded.h5 layout: int64, padded to ``width``, original_sequence
    included."""
    n = stop - start
    ids = np.zeros((n, 4, width), dtype=np.int64)
    offs = block.offsets()
    for r, i in enumerate(range(start, stop)):
        a, b = offs[i], offs[i + 1]
        for row, f in enumerate(NARROW):
            ids[r, row, : b - a] = block.columns[f][a:b]
    mask = (np.arange(width) < block.columns["length"][start:stop, None]).astype(np.int64)
    return {"input_ids": ids, "padding_mask": mask, "original_sequence": ids[:, 0].copy(),
            "sequence_id": block.columns["person_id"][start:stop].astype(np.int64)}


def write_seed_h5(path: Path, block: Block, gzip: bool) -> None:
    """The seed's encoded.h5 (gzip level 4, chunks of 64 rows), or the same uncompressed (its in-memory variant)."""
    tmp = path.with_name(path.name + ".tmp")
    n = block.n
    with h5py.File(tmp, "w") as f:
        shapes = {"input_ids": (n, 4, SEQ), "padding_mask": (n, SEQ), "original_sequence": (n, SEQ),
                  "sequence_id": (n,)}
        dsets = {k: f.create_dataset(k, shape=s, dtype="int64", chunks=(min(64, n), *s[1:]),
                                     compression="gzip" if gzip else None, compression_opts=4 if gzip else None)
                 for k, s in shapes.items()}
        for start in range(0, n, 4096):
            stop = min(start + 4096, n)
            for k, v in seed_rows(block, start, stop).items():
                dsets[k][start:stop] = v
    tmp.rename(path)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def bars(rows: dict[str, dict[str, Any]]) -> list[tuple[str, float | None, str, bool | None]]:
    """(claim, measured ratio, threshold, pass) for each of the loader bench's bars (docs/results/reader.md)."""
    def get(name: str, col: str) -> float | None:
        v = rows.get(name, {}).get(col)
        return float(v) if v is not None else None

    rival = max((get(n, "persons_per_s") or 0.0 for n in RIVALS), default=0.0) or None
    w1 = get("ours-w1", "persons_per_s")
    first = get("ours-10k-shards", "first_batch_s")
    checks = [
        ("our reader (1 worker) vs fastest of contenders 2-5, persons/s", ratio(w1, rival), ">= 3", 3.0, True),
        ("our reader (1 worker) vs zstd-decompress limit", ratio(w1, get("zstd-limit", "persons_per_s")), ">= 0.3",
         0.3, True),
        ("bytes on disk/person vs seed gzip h5", ratio(get("ours-w0", "disk_bytes_per_person"),
                                                       get("seed-h5", "disk_bytes_per_person")), "<= 0.5", 0.5, False),
        ("host->device bytes/person vs seed batch", ratio(get("ours-w0", "h2d_bytes_per_person"),
                                                         get("seed-h5", "h2d_bytes_per_person")), "<= 0.1", 0.1, False),
        ("time to first batch (s), dataset of many shards", first, "< 2", 2.0, False),
        ("our reader 2 workers vs 1 worker, persons/s", ratio(get("ours-w2", "persons_per_s"), w1), ">= 1.5", 1.5,
         True),
    ]
    return [(c, v, t, None if v is None else (v >= lim if higher else v <= lim)) for c, v, t, lim, higher in checks]
