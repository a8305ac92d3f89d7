"""Loader benchmark: our reader against the seed's h5 pattern, webdataset and LitData, on the same persons.

One command, one run: a synthetic population is converted once per format, then every contender iterates the train
persons into padded batches of 256 in a fresh subprocess (so its peak RSS is its own). Machines are shared and
noisy, so the verdicts are ratios measured in this run, never absolute numbers.

Data: ``shardify synth`` persons -> ``convert_dataset`` (no val split) -> the train shards are read back (the
remainder shard included: training reads it too) and written in every other format, so all contenders see the same
persons (our reader on 2 readers leaves out the split's persons mod 2, as training does).

Usage: python -m tools.bench_loader [--people 200000] [--quick] [--work bench-data] [--out docs/results]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm import tqdm

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.store.format import (
    FORMAT_VERSION,
    MIN_SHARD_PERSONS,
    Block,
    Field,
    decode_block,
    decompress,
    make_schema,
    token_schema,
)
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import iter_tar_members
from tools.common import NARROW, bars, ratio, read_persons, train_shards, write_csv, write_seed_h5

ROOT = Path(__file__).resolve().parent.parent
BATCH = 256
SEED_KEYS = ("input_ids", "padding_mask", "original_sequence", "sequence_id")
# our dataset: no val split; shards a multiple of 2, so both the 1- and the 2-worker reader divide them
OURS_OPTIONS: dict[str, Any] = {"num_val": 0, "workers": 2, "min_shard_persons": MIN_SHARD_PERSONS}
WDS_SHARD_PERSONS = 10_000
MANY_SHARDS = 10_000


# ---------------------------------------------------------------------------------------------------------------
# Data: one population, every format.


RAGGED_FIELDS = ("tokens", "abspos", "age", "segment")


def person_arrays(block: Block) -> Iterable[tuple[int, dict[str, np.ndarray]]]:
    offs = block.offsets()
    for i, pid in enumerate(block.columns["person_id"].tolist()):
        yield pid, {f: block.columns[f][offs[i]:offs[i + 1]] for f in RAGGED_FIELDS}


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def npy_members(block: Block) -> Iterable[tuple[str, bytes]]:
    """Layout (a): webdataset samples ``<person_id>.<field>.npy`` (the key carries the person id)."""
    for pid, arrays in person_arrays(block):
        for f, a in arrays.items():
            yield f"{pid}.{f}.npy", npy_bytes(a)


def write_wds(out: Path, block: Block) -> None:
    out.mkdir()
    for i, start in enumerate(range(0, block.n, WDS_SHARD_PERSONS)):
        part = block.take(np.arange(start, min(start + WDS_SHARD_PERSONS, block.n)), schema_of(block))
        write_tar(out / f"shard-{i:06d}.tar", npy_members(part))


def schema_of(block: Block) -> list[Field]:
    """The per-token schema of a block read back from our shards."""
    return token_schema(make_schema(str(block.columns["tokens"].dtype),
                                    {f: str(block.columns[f].dtype) for f in NARROW}))


@functools.lru_cache(maxsize=1)
def _persons_npz(path: str) -> Block:
    with np.load(path) as z:
        return Block({k: z[k] for k in z.files})


def _litdata_items(task: tuple[str, int, int]) -> Iterator[dict[str, Any]]:
    """litdata.optimize's fn: persons [start, stop) of the saved population, one dict each."""
    path, start, stop = task
    part = _persons_npz(path).take(np.arange(start, stop), schema_of(_persons_npz(path)))
    for pid, arrays in person_arrays(part):
        yield {"person_id": pid, **arrays}


def write_litdata(out: Path, npz: Path, n: int) -> None:
    import litdata

    tasks = [(str(npz), s, min(s + 2000, n)) for s in range(0, n, 2000)]
    # litdata.optimize sets the process-wide start method to spawn (force=True) and leaves it: every DataLoader
    # started later in this process would then pickle its dataset (a test's lambda collate_fn failed so).
    before = multiprocessing.get_start_method()
    try:
        litdata.optimize(fn=_litdata_items, inputs=tasks, output_dir=str(out), chunk_bytes="32MB",
                         compression="zstd", num_workers=2, mode="overwrite")
    finally:
        multiprocessing.set_start_method(before, force=True)


def prepare(work: Path, people: int, many_shards: int) -> None:
    """Build every format once (each step skipped when its output exists: reruns reuse the data)."""
    work.mkdir(parents=True, exist_ok=True)
    raw, ours = work / "raw", work / "ours"
    steps: list[tuple[Path, Callable[[], None]]] = [
        (raw / "vocab.csv", lambda: synth_population(raw, people, seed=0)),
        (ours / "manifest.json", lambda: convert_dataset(
            [str(raw / "sequences.parquet")], ours, str(raw / "vocab.csv"),
            ConvertOptions(processes=2, overwrite=True, **OURS_OPTIONS))),
        (work / "persons.npz", lambda: np.savez(work / "persons.npz", **read_persons(ours).columns)),
        (work / "seed_gzip.h5", lambda: write_seed_h5(work / "seed_gzip.h5", persons(work), gzip=True)),
        (work / "seed_raw.h5", lambda: write_seed_h5(work / "seed_raw.h5", persons(work), gzip=False)),
        (work / "wds", lambda: write_wds(work / "wds", persons(work))),
        (work / "litdata", lambda: write_litdata(work / "litdata", work / "persons.npz", persons(work).n)),
        (work / "many" / "manifest.json", lambda: make_many(work, many_shards)),
    ]
    if _stale(ours):  # converted by an older version or with other options: every format is built again
        for old in (ours, work / "persons.npz", work / "seed_gzip.h5", work / "seed_raw.h5", work / "wds",
                    work / "litdata"):
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
    if _stale(work / "many", {}):
        shutil.rmtree(work / "many")
    for out, make in tqdm(steps, desc="prepare formats", unit="format"):
        if not out.exists():
            make()


def _stale(dataset: Path, options: dict[str, Any] = OURS_OPTIONS) -> bool:
    """A dataset built by another format version, or with other conversion options than this bench asks for."""
    if not (dataset / "manifest.json").exists():
        return False
    m = read_manifest(dataset)
    return m.format_version != FORMAT_VERSION or any((m.params or {}).get(k) != v for k, v in options.items())


def make_many(work: Path, shards: int) -> None:
    """A dataset of ``shards`` tiny shards (one person each): time to first batch must not grow with the count."""
    raw = work / "many-raw"
    synth_population(raw, shards + shards // 5 + 20, seed=1, progress=False)  # synth drops ~3 % (too few events)
    convert_dataset([str(raw / "sequences.parquet")], work / "many", str(raw / "vocab.csv"),
                    ConvertOptions(num_val=0, shards=shards, overwrite=True, progress=False))


def persons(work: Path) -> Block:
    return _persons_npz(str(work / "persons.npz"))


# ---------------------------------------------------------------------------------------------------------------
# Batching shared by the contenders that yield single persons (webdataset, LitData): our host batch layout.


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Persons -> padded narrow batch, L = longest rounded up to a multiple of 8 (what our reader yields)."""
    lengths = np.array([len(s["tokens"]) for s in samples], dtype=np.int64)
    width = int(-(-lengths.max() // 8) * 8)
    out = {"person_id": torch.tensor([int(s["person_id"]) for s in samples], dtype=torch.int64),
           "lengths": torch.from_numpy(lengths)}
    for f, dt in NARROW.items():
        arr = np.zeros((len(samples), width), dtype=dt)
        for r, s in enumerate(samples):
            arr[r, : lengths[r]] = s[f]
        out[f] = torch.from_numpy(arr)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Contenders: each returns an iterable of batches (dicts of tensors), or of (persons, tokens) for the limits.


def ours(work: Path, workers: int, root: str = "ours", rank: int = 0, world_size: int = 1) -> Iterable[Any]:
    from lifeseq_shards import ShardedDataset, ShardedLoader
    from lifeseq_shards.reader import World

    # packed: one buffer of real tokens per batch; the training step pads it on the device (device.padded_fields)
    ds = ShardedDataset(str(work / root), split="train", batch_size=BATCH, num_workers=workers, mode="balanced",
                        shuffle=True, seed=0, packed=True, world=World(rank, world_size))
    return ShardedLoader(ds)


def ours_side_by_side(work: Path) -> Iterable[Any]:
    """One of SIDE_BY_SIDE processes started together, each an in-process reader of its rank's half (BENCH_RANK):
    two cores' worth of reading with no worker pipe and no main process to feed, the most any 2-worker loader of
    this reader can reach on this machine."""
    return ours(work, 0, rank=int(os.environ["BENCH_RANK"]), world_size=SIDE_BY_SIDE)


class SeedH5Rows(IterableDataset):  # type: ignore[type-arg]
    """The seed's pattern: open the h5 file and yield one row at a time (DataLoader batches them)."""

    def __init__(self, path: Path):
        self.path = path

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        with h5py.File(self.path, "r") as f:
            dsets = [(k, f[k]) for k in SEED_KEYS]
            for i in range(len(f["sequence_id"])):
                yield {k: torch.from_numpy(np.asarray(d[i])) for k, d in dsets}


class SeedInMemory(Dataset):  # type: ignore[type-arg]
    """The seed's in-memory dataset: every array loaded whole, rows indexed."""

    def __init__(self, path: Path):
        with h5py.File(path, "r") as f:
            self.arrays = {k: torch.from_numpy(f[k][:]) for k in SEED_KEYS}

    def __len__(self) -> int:
        return len(self.arrays["sequence_id"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.arrays.items()}


def seed_h5(work: Path) -> Iterable[Any]:
    return DataLoader(SeedH5Rows(work / "seed_gzip.h5"), batch_size=BATCH)


def seed_memory(work: Path) -> Iterable[Any]:
    return DataLoader(SeedInMemory(work / "seed_raw.h5"), batch_size=BATCH, shuffle=False)


def _wds_sample(s: dict[str, Any]) -> dict[str, Any]:
    return {"person_id": int(s["__key__"]), **{f: s[f"{f}.npy"] for f in NARROW}}


def webdataset(work: Path) -> Iterable[Any]:
    import webdataset as wds

    urls = [str(p) for p in sorted((work / "wds").glob("*.tar"))]
    return (wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode().map(_wds_sample)
            .batched(BATCH, collation_fn=pad_collate, partial=True))


def litdata(work: Path) -> Iterable[Any]:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(str(work / "litdata"), shuffle=False)
    return StreamingDataLoader(ds, batch_size=BATCH, collate_fn=pad_collate, num_workers=0)


def _members(work: Path) -> list[tuple[bytes, int, int]]:
    """Our train shards' compressed blocks in RAM, with their (persons, tokens)."""
    schema = read_manifest(work / "ours").schema
    out = []
    for path in train_shards(work / "ours"):
        with open(path, "rb") as fh:
            for _, data in iter_tar_members(fh):
                b = decode_block(decompress(data), schema)
                out.append((data, b.n, int(b.offsets()[-1])))
    return out


def zstd_limit(work: Path) -> Iterator[tuple[int, int]]:
    members = _members(work)
    yield 0, 0  # the first "batch": loading the members into RAM is not part of the limit
    for data, n, t in members:
        decompress(data)
        yield n, t


def memcpy_limit(work: Path) -> Iterator[tuple[int, int]]:
    members = [(decompress(d), n, t) for d, n, t in _members(work)]
    yield 0, 0
    for raw, n, t in members:
        bytearray(raw)
        yield n, t


CONTENDERS: dict[str, tuple[str, Callable[[Path], Iterable[Any]], str]] = {
    "ours-w0": ("our reader, num_workers=0", lambda w: ours(w, 0), "ours"),
    "ours-w1": ("our reader, num_workers=1", lambda w: ours(w, 1), "ours"),
    "ours-w2": ("our reader, num_workers=2", lambda w: ours(w, 2), "ours"),
    "seed-h5": ("seed h5 gzip, per-row IterableDataset", seed_h5, "seed_gzip.h5"),
    "seed-mem": ("seed h5 uncompressed, in memory", seed_memory, "seed_raw.h5"),
    "webdataset": ("webdataset, .npy per field per person", webdataset, "wds"),
    "litdata": ("LitData StreamingDataset, zstd", litdata, "litdata"),
    "zstd-limit": ("limit: zstd decompress of our blocks", zstd_limit, "ours"),
    "memcpy-limit": ("limit: memcpy of the raw blocks", memcpy_limit, "ours"),
    "ours-10k-shards": ("our reader on many 1-person shards (first batch only)",
                        lambda w: ours(w, 0, "many"), "many"),
    "ours-2x-w0": ("ceiling: 2 in-process readers side by side, half each", ours_side_by_side, "ours"),
}
OURS = ("ours-w0", "ours-w1", "ours-w2", "ours-10k-shards")
LIMITS = ("zstd-limit", "memcpy-limit", "ours-2x-w0")  # bounds, drawn grey
SIDE_BY_SIDE = 2  # processes of "ours-2x-w0", run at once


def processes(name: str) -> int:
    """How many processes measure the contender at once (each reads its share of the train split)."""
    return SIDE_BY_SIDE if name == "ours-2x-w0" else 1


def readers(name: str) -> int:
    """Our reader's slots (ranks x workers) for the contender: an epoch leaves out persons mod readers."""
    return 2 if name in ("ours-w2", "ours-2x-w0") else 1


def batch_stats(batch: Any) -> tuple[int, int, int | None]:
    """(persons, real tokens, bytes shipped to the device) of one batch, whatever its layout."""
    if isinstance(batch, tuple):
        return batch[0], batch[1], None
    from lifeseq_shards.device.batch import PackedBatch, PaddedBatch
    from lifeseq_shards.device.build import packed_views

    if isinstance(batch, PackedBatch | PaddedBatch):
        fields = packed_views(batch) if isinstance(batch, PackedBatch) else batch.tensors
        return len(fields["person_id"]), int(fields["lengths"].sum()), batch.nbytes
    nbytes = sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
    if "padding_mask" in batch:
        return len(batch["sequence_id"]), int(batch["padding_mask"].sum()), nbytes
    return len(batch["person_id"]), int(batch["lengths"].sum()), nbytes


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if (path / "manifest.json").exists():  # our dataset: the train shards the reader reads
        return sum(p.stat().st_size for p in train_shards(path))
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def peak_rss_mb() -> int:
    """This process's own peak RSS: VmHWM restarts at exec (ru_maxrss keeps the forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def measure(name: str, work: Path, max_seconds: float, first_only: bool = False,
            min_seconds: float = 0.0) -> dict[str, Any]:
    """Iterate one contender; rates are steady state (after the first batch), first-batch time is separate.

    A contender faster than ``min_seconds`` per pass goes round again (a new epoch of the same loader, workers
    kept), so a one-second pass does not measure mostly worker start-up."""
    label, make, data = CONTENDERS[name]
    t0 = time.perf_counter()
    source = make(work)
    it = iter(source)
    first = next(it)
    t1 = time.perf_counter()
    persons = tokens = h2d = 0
    p0, _, b0 = batch_stats(first)
    passes, first_pass = 0, None
    while not first_only:
        seen = 0
        for batch in it:
            p, t, b = batch_stats(batch)
            persons, tokens, seen = persons + p, tokens + t, seen + 1
            h2d += b or 0
            if time.perf_counter() - t1 > max_seconds:
                break
        passes += 1 if seen or passes == 0 else 0
        first_pass = persons + p0 if first_pass is None else first_pass
        if not seen or time.perf_counter() - t1 >= min_seconds:
            break
        it = iter(source)
    secs = max(time.perf_counter() - t1, 1e-9)
    everyone = first_pass or p0
    return {
        "contender": name, "label": label, "persons": everyone,
        "complete": everyone == (persons_total(work, name) // readers(name) * readers(name)) // processes(name),
        "passes": passes,
        "persons_per_s": round(persons / secs) if persons else None,
        "tokens_per_s": round(tokens / secs) if persons else None,
        "disk_bytes_per_person": round(disk_bytes(work / data) / persons_total(work, name), 1),
        "h2d_bytes_per_person": round((h2d + (b0 or 0)) / (persons + p0), 1) if b0 else None,
        "first_batch_s": round(t1 - t0, 3),
        "peak_rss_mb": peak_rss_mb(),
    }


def persons_total(work: Path, name: str) -> int:
    """The train persons, remainder included."""
    return read_manifest(work / ("many" if name == "ours-10k-shards" else "ours")).splits["train"].persons


# ---------------------------------------------------------------------------------------------------------------
# The run: one subprocess per contender, then the table, the bars, the CSV and the chart.


def run_child(name: str, work: Path, max_seconds: float, min_seconds: float) -> dict[str, Any]:
    """Measure a contender in its own process; "ours-2x-w0" in SIDE_BY_SIDE processes at once, rates summed."""
    cmd = [sys.executable, "-m", "tools.bench_loader", "--child", name, "--work", str(work.resolve()),
           "--max-seconds", str(max_seconds), "--min-seconds", str(min_seconds)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "BENCH_RANK": str(r)}) for r in range(processes(name))]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            tail = err.strip().splitlines()[-1:] or ["(no output)"]
            return {"contender": name, "label": CONTENDERS[name][0], "error": tail[0]}
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results[0] if len(results) == 1 else combine(results)


def combine(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Processes that ran at once as one contender: rates and persons add up, the slowest start and the largest
    RSS count."""
    row = dict(parts[0])
    for col in ("persons", "persons_per_s", "tokens_per_s"):
        row[col] = sum(p[col] for p in parts)
    row["complete"] = all(p["complete"] for p in parts)
    row["passes"] = min(p["passes"] for p in parts)
    row["first_batch_s"] = max(p["first_batch_s"] for p in parts)
    row["peak_rss_mb"] = max(p["peak_rss_mb"] for p in parts)
    return row


def ceiling(rows: dict[str, dict[str, Any]]) -> list[tuple[str, float | None]]:
    """What this machine allows the 2-worker bar: two readers side by side with nothing to share, against one."""
    def rate(name: str) -> float | None:
        return rows.get(name, {}).get("persons_per_s")

    return [("2 in-process readers side by side vs 1 in-process reader", ratio(rate("ours-2x-w0"), rate("ours-w0"))),
            ("our reader 2 workers vs the 2 side by side", ratio(rate("ours-w2"), rate("ours-2x-w0")))]


def report(rows: list[dict[str, Any]], out: Path | None, people: int) -> None:
    cols = ["persons_per_s", "tokens_per_s", "disk_bytes_per_person", "h2d_bytes_per_person", "first_batch_s", "passes",
            "peak_rss_mb", "persons"]
    print(f"\n{people} synthetic persons, batches of {BATCH}, one subprocess per contender\n")
    print("| contender | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for r in rows:
        cells = [r.get("error", "")] if "error" in r else [_fmt(r.get(c)) for c in cols]
        print(f"| {r['label']} | " + " | ".join(cells) + " |")
    by_name = {r["contender"]: r for r in rows if "error" not in r}
    print("\n| bar | measured | needed | verdict |\n| --- | ---: | --- | --- |")
    for claim, value, need, ok in bars(by_name):
        verdict = "n/a (contender missing)" if ok is None else "PASS" if ok else "FAIL"
        print(f"| {claim} | {_fmt(None if value is None else round(value, 3))} | {need} | {verdict} |")
    print("\n| context for the 2-worker bar | ratio |\n| --- | ---: |")
    for claim, value in ceiling(by_name):
        print(f"| {claim} | {_fmt(None if value is None else round(value, 3))} |")
    if out is None:
        return
    write_csv(out / "loader.csv", rows, ["contender", "label", *cols, "complete", "error"])
    chart(rows, out / "loader.png", people)
    print(f"wrote {out / 'loader.csv'} and {out / 'loader.png'}")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,}" if isinstance(v, int) else str(v)


def chart(rows: list[dict[str, Any]], path: Path, people: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("persons_per_s")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.2))
    colors = ["tab:blue" if r["contender"] in OURS else "tab:gray" if r["contender"] in LIMITS else "tab:orange"
              for r in shown]
    ax.barh([r["label"] for r in shown], [r["persons_per_s"] for r in shown], color=colors)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("persons/s (log scale, steady state, one run)")
    ax.set_title(f"Batches of {BATCH}, {people:,} synthetic persons (ours packed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--people", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="3,000 persons, 200 tiny shards, 10 s per contender")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data", help="formats are built here and reused")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="loader.csv and loader.png")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="stop a contender after this (rates stay valid)")
    ap.add_argument("--min-seconds", type=float, default=8.0,
                    help="a contender faster than this per pass reads more epochs (steady state, not start-up)")
    ap.add_argument("--only", nargs="*", choices=list(CONTENDERS), help="run these contenders only")
    ap.add_argument("--child", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.work, args.max_seconds, args.child == "ours-10k-shards",
                                 args.min_seconds)))
        return
    if importlib.util.find_spec("streaming") is None:
        print("note: MosaicML Streaming is not importable here; it is not a contender in this run")
    people, many, secs = (3000, 200, 10.0) if args.quick else (args.people, MANY_SHARDS, args.max_seconds)
    min_secs = 0.0 if args.quick else args.min_seconds
    work = args.work / f"p{people}"
    prepare(work, people, many)
    names = args.only or list(CONTENDERS)
    rows = [run_child(n, work, secs, min_secs) for n in tqdm(names, desc="contenders", unit="run")]
    report(rows, args.out, people)


if __name__ == "__main__":
    main()
