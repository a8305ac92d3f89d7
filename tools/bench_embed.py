"""Embedding benchmark: our EmbeddingWriter on 2 ranks against the researchers' pattern, same persons.

One command, one run. Per population size a synthetic dataset is converted once (short sequences, ``--seq``
tokens, shards of about ``--shard-persons``), then each contender embeds every person with the same reference model
(a tiny size, fp32) in fresh subprocesses, so that each peak RSS is its own:

- ``ours``: 2 ranks (gloo, one CPU thread each), each ``EmbeddingWriter.dataset`` + ``ShardedLoader`` + the
  model's ``predict_step`` + ``EmbeddingWriter.write``: one Parquet file per input shard.
- ``theirs``: the pattern of the seed's ``infer_embedding.py``: one process loads every person into memory as a
  padded array (their ``CustomInMemoryDataset``), a ``DataLoader`` over it, the same model and pooling, and each
  batch appended to one HDF5 file (their ``write_to_hdf5``), in float32.

Machines are shared and noisy: the verdicts are the ratios of this run (persons/s, peak RSS).

Usage: python -m tools.bench_embed [--persons 100000 1000000 3000000] [--work bench-embed] [--out docs/results]
On a GPU (tools/device_check.sh embed): python -m tools.bench_embed --device cuda --data DS --size large --out OUT
(one rank, packed batches, the padding-free path, bf16 autocast and fp32: persons/s, peak host RSS and GPU memory).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.device.batch import PaddedModelBatch
from lifeseq_shards.reader import World
from lifeseq_shards.store.remote import read_manifest
from tools.common import write_csv

BATCH = 512
SIZE = (16, 32, 1, 2)  # hidden, ff, layers, heads: a tiny reference model, so 3M persons take minutes on CPU


def dataset(work: Path, persons: int, seq: int, shard_persons: int) -> Path:
    """The converted dataset of ``persons`` synthetic persons (kept between runs in ``work``)."""
    root = work / f"p{persons}-s{seq}"
    if not (root / "ds" / "manifest.json").exists():
        synth_population(root / "raw", persons, seed=0)
        convert_dataset([str(root / "raw" / "sequences.parquet")], root / "ds", vocab=str(root / "raw" / "vocab.csv"),
                        opts=ConvertOptions(max_seq_len=seq, min_shard_persons=shard_persons, processes=2,
                                            overwrite=True))
    return root / "ds"


def model_for(root: str) -> Any:
    from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule

    torch.manual_seed(0)
    return LifeSeqPretrainModule(EncoderConfig(*SIZE), int(read_manifest(root).vocab_size), dropout=0.0).eval()


def peak_rss_mb() -> float:
    """This process's peak RSS since its exec (VmHWM; getrusage's ru_maxrss also counts the parent's at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


# -- the contenders, each run in its own process ------------------------------------------------------------------
def run_ours(root: str, out: str) -> dict[str, float]:
    from lifeseq_shards import EmbeddingWriter, ShardedLoader
    from lifeseq_shards.device.build import BatchBuilder

    torch.set_num_threads(1)  # two ranks on two cores
    torch.distributed.init_process_group("gloo")
    model = model_for(root)
    start = time.perf_counter()
    writer = EmbeddingWriter(out)
    builder = BatchBuilder()
    persons = 0
    with torch.no_grad():
        for i, batch in enumerate(ShardedLoader(writer.dataset(root, batch_size=BATCH, model=model))):
            model_batch = builder(batch, "cpu", 0)
            writer.write(model.predict_step(model_batch, i), model_batch)
            persons += len(model_batch["person_id"])
    writer.finish()
    seconds = time.perf_counter() - start
    torch.distributed.destroy_process_group()
    return {"persons": persons, "seconds": seconds, "peak_rss_mb": peak_rss_mb()}


class InMemory(Dataset):
    """Every person padded in memory, one dict of tensors per item: what the seed's CustomInMemoryDataset serves."""

    def __init__(self, root: str, width: int) -> None:
        from lifeseq_shards import ShardedDataset, ShardedLoader

        ds = ShardedDataset(root, split=("train", "val"), batch_size=4096, mode="complete", pad_to=width,
                            world=World(0, 1))
        parts = list(ShardedLoader(ds))
        self.input_ids = torch.cat([torch.stack([b[k].long() for k in ("tokens", "abspos", "age", "segment")], 1)
                                    for b in parts])
        self.padding_mask = torch.cat([(torch.arange(width) < b["lengths"][:, None]).long() for b in parts])
        self.sequence_id = torch.cat([b["person_id"] for b in parts])

    def __len__(self) -> int:
        return len(self.sequence_id)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "padding_mask": self.padding_mask[i],
                "sequence_id": self.sequence_id[i]}


def append_h5(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Append one batch to resizable HDF5 datasets (created on the first batch), as the seed writes per batch."""
    with h5py.File(path, "a") as f:
        for name, a in arrays.items():
            if name not in f:
                f.create_dataset(name, data=a, maxshape=(None, *a.shape[1:]), chunks=True)
            else:
                f[name].resize(f[name].shape[0] + len(a), axis=0)
                f[name][-len(a):] = a


def run_theirs(root: str, out: str, width: int) -> dict[str, float]:
    model = model_for(root)
    start = time.perf_counter()
    Path(out).unlink(missing_ok=True)
    persons = 0
    with torch.no_grad():
        for batch in DataLoader(InMemory(root, width), batch_size=BATCH):
            model_batch = PaddedModelBatch({"input_ids": batch["input_ids"], "padding_mask": batch["padding_mask"],
                                            "lengths": batch["padding_mask"].sum(1), "person_id": batch["sequence_id"]})
            emb = model.predict_step(model_batch, 0)
            append_h5(out, {"sequence_id": batch["sequence_id"].numpy(), "cls_emb": emb["cls"].numpy(),
                            "mean_emb": emb["mean"].numpy()})
            persons += len(batch["sequence_id"])
    return {"persons": persons, "seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb()}


def run_device(root: str, out: str, size: str, precision: str, device: str, workers: int) -> dict[str, Any]:
    """One rank on ``device``: the reference model at ``size`` under ``precision`` (bf16 autocast or fp32), packed
    batches with ``workers`` loader workers, the padding-free path; persons/s and peak memories."""
    from lifeseq_shards import EmbeddingWriter, ShardedLoader
    from lifeseq_shards.device.build import BatchBuilder
    from lifeseq_shards.model import LifeSeqPretrainModule

    torch.manual_seed(0)
    model = LifeSeqPretrainModule(size, int(read_manifest(root).vocab_size)).eval().to(device)
    writer = EmbeddingWriter(out, model=f"{size} seed 0 {precision}")
    builder = BatchBuilder(layout="packed")
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")
    start, persons = time.perf_counter(), 0
    loader = ShardedLoader(writer.dataset(root, batch_size=BATCH, model=model, num_workers=workers, packed=True,
                                          world=World(0, 1)), pin_memory=device.startswith("cuda"))
    with torch.no_grad(), autocast:
        for i, batch in enumerate(loader):
            model_batch = builder(batch, device, 0)
            writer.write(model.predict_step(model_batch, i), model_batch)
            persons += len(model_batch["person_id"])
    writer.finish()
    seconds = time.perf_counter() - start
    gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
    return {"size": size, "precision": precision, "persons": persons, "persons_s": round(persons / seconds),
            "peak_rss_mb": round(peak_rss_mb()), "peak_gpu_mb": round(gpu)}


# -- the driver ---------------------------------------------------------------------------------------------------
def _job(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tools.bench_embed", "--job", *args], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=Path(__file__).resolve().parent.parent)


def _result(p: subprocess.Popen) -> dict[str, float]:
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(f"a benchmark job failed (exit {p.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def measure(root: Path, work: Path, seq: int, theirs: bool = True) -> dict[str, Any]:
    """Both contenders on ``root`` (ours alone without ``theirs``); ours' output is removed first, so it embeds
    everything."""
    out = work / "out" / root.parent.name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [_job("ours", str(root), str(out / "ours"),
                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                       "WORLD_SIZE": "2"}) for r in range(2)]
    wall = time.perf_counter()
    per_rank = [_result(p) for p in ranks]
    wall = time.perf_counter() - wall
    other = _result(_job("theirs", str(root), str(out / "theirs.h5"), str(seq))) if theirs else None
    ours = {"persons": sum(r["persons"] for r in per_rank), "seconds": max(r["seconds"] for r in per_rank),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
            "peak_rss_mb_sum": sum(r["peak_rss_mb"] for r in per_rank), "wall_seconds": wall}
    return {"ours": ours, "theirs": other, "out": {"ours": str(out / "ours"), "theirs": str(out / "theirs.h5")}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--persons", type=int, nargs="+", default=[100_000, 1_000_000, 3_000_000])
    p.add_argument("--seq", type=int, default=32, help="tokens kept per person")
    p.add_argument("--shard-persons", type=int, default=16384)
    p.add_argument("--work", type=Path, default=Path("bench-embed"))
    p.add_argument("--out", type=Path, default=None, help="write embed.csv here (docs/results)")
    p.add_argument("--theirs-max", type=int, default=None,
                   help="run the seed's pattern only up to this many persons (it is ~20x slower on CPU)")
    p.add_argument("--device", help="instead: one rank on this device (cuda), over --data, for each --precisions")
    p.add_argument("--data", help="with --device: the dataset to embed")
    p.add_argument("--size", default="large", help="with --device: the reference model's size (model.SIZES)")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--job", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device:
        rows = []
        for precision in args.precisions:
            out = args.work / f"device-{args.size}-{precision}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            rows.append(run_device(args.data, str(out), args.size, precision, args.device, args.workers))
            print(json.dumps(rows[-1]), flush=True)
        if args.out is not None:
            write_csv(args.out / "embed-device.csv", rows)
        return
    if args.job:
        kind, root, out, *rest = args.job
        result = run_ours(root, out) if kind == "ours" else run_theirs(root, out, int(rest[0]))
        print(json.dumps(result))
        return
    rows = []
    for n in args.persons:
        root = dataset(args.work, n, args.seq, args.shard_persons)
        r = measure(root, args.work, args.seq, theirs=args.theirs_max is None or n <= args.theirs_max)
        ours, theirs = r["ours"], r["theirs"]
        row: dict[str, Any] = {"persons": ours["persons"], "ours_persons_s": round(ours["persons"] / ours["seconds"]),
                               "ours_peak_rss_mb_per_rank": round(ours["peak_rss_mb"]),
                               "ours_peak_rss_mb_2_ranks": round(ours["peak_rss_mb_sum"])}
        if theirs is not None:
            row.update(theirs_persons_s=round(theirs["persons"] / theirs["seconds"]),
                       speed_ratio=round(theirs["seconds"] / ours["seconds"], 2),
                       theirs_peak_rss_mb=round(theirs["peak_rss_mb"]),
                       rss_ratio_vs_2_ranks=round(theirs["peak_rss_mb"] / ours["peak_rss_mb_sum"], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        write_csv(args.out / "embed.csv", rows)


if __name__ == "__main__":
    main()
