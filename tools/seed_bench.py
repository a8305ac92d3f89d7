"""The researchers' own pre-training, timed on one device: their ``pretrain.py`` with their own loader (their HDF5 file,
their ``CustomInMemoryDataset`` / DataLoader) against the same script patched by docs/seed-pretrain.diff
(``LifeSeqDataModule`` on the shards converted from that very HDF5 file), on the same synthetic persons with the same
masks, the same model, hyperparameters and precision (results: docs/results/training-gpu.md, "Their training").

    python -m tools.seed_bench prepare REPO --work DIR [--commit 884ef02] [--persons 6000] [--long-persons 2000]
    python -m tools.seed_bench run --work DIR --out OUT [--plan gpu|cpu] [--python PY] [--deps DIR] [--budget-s S]

``prepare`` (here, with the network and git): their commit twice into DIR (``theirs/`` as it is, ``patched/`` with
the diff), and per length L synthetic persons (``shardify synth``) written as their step-5 ``encoded_mlm.h5`` (int64,
padded to L, gzip; MLM targets drawn once by ``DynamicMasker``, the seed's rules, in their target-slot layout), then
``shardify convert`` of that file: ``DIR/data-L/``. ``run`` (on the device machine, no network, no git): each point
of the plan in a process of its own (tools/seed_bench_point.py), most important first, one JSON line per point in
``OUT/seed.jsonl`` as it finishes (a failed or timed-out point is a line too) and ``OUT/seed.md`` after each; no
point starts past ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
THEIR_PATHS = ("pop2vec/__init__.py", "pop2vec/llm/src")  # what their pretrain.py imports (pop2vec.llm: a namespace)
NUM_VAL = 64  # their NUM_VAL_ITEMS and the shards' val split: validation does not run in a point, so it is small

# Their model sizes: overrides of their regular_hparams_small.txt (its other settings stay: swish, ReZero, dropouts
# 0.1, 7 local heads with a window of 38, 436 random features, weight tying). small and medium are their files'
# dims; base their D3-hparams-large.txt's (BERT-base: 768 / 3072 / 12 layers / 12 heads, max_length 1024); tiny is
# tools/seed_pretrain_check.py's size, for the CPU dry run.
SIZES: dict[str, dict[str, Any]] = {
    "small": {"hidden_size": 160, "hidden_ff": 1240, "n_encoders": 3, "n_heads": 10},
    "medium": {"hidden_size": 280, "hidden_ff": 2210, "n_encoders": 5, "n_heads": 10},
    "base": {"hidden_size": 768, "hidden_ff": 3072, "n_encoders": 12, "n_heads": 12},
    "tiny": {"hidden_size": 32, "hidden_ff": 64, "n_encoders": 1, "n_heads": 4, "n_local": 2,
             "local_window_size": 16, "num_random_features": 16},
}


@dataclass(frozen=True)
class Point:
    stack: str  # a name for --python: newest | pinned
    loader: str  # theirs (their HDF5 file and DataLoader) | shards (the diff's LifeSeqDataModule)
    size: str
    max_len: int
    batch_size: int
    precision: str  # 32-true (their PRECISION, with their TF32 matmuls) | bf16-mixed
    attention: str  # performer (theirs) | full-padded | full-packed (tools/seed_bench_point.py)


def plan(kind: str, stack: str) -> list[Point]:
    """The points, most important first: their model as it runs (32-true with their TF32 matmuls, performer), before
    and after, per size at batch 64 and 256; then bf16-mixed; then full attention, padded against padding-free, at
    512 and 1,024 tokens (what switching attention buys them: their base dims at batch 64, near their 50, bf16, the
    diff's loader, their performer beside it)."""
    if kind == "cpu":  # every code path once, at sizes a 2-core CPU runs in seconds
        pairs = [("tiny", 64, 8, "32-true", "performer"), ("tiny", 64, 8, "bf16-mixed", "performer")]
        attention = [("tiny", 64, 8, "32-true", a) for a in ("full-padded", "full-packed")]
    else:
        fp32 = [("small", 512, 64), ("small", 512, 256), ("medium", 512, 256), ("base", 512, 64),
                ("medium", 512, 64), ("base", 512, 256)]
        pairs = [(*p, "32-true", "performer") for p in fp32] + \
            [(size, 512, 256, "bf16-mixed", "performer") for size in ("small", "medium", "base")]
        attention = [("base", length, 64, "bf16-mixed", a) for length in (512, 1024)
                     for a in ("performer", "full-padded", "full-packed")]
    return [Point(stack, loader, *p) for p in pairs for loader in ("theirs", "shards")] + \
        [Point(stack, "shards", *p) for p in attention]


def hparams_text(their: str, size: str, point: Point, vocab_size: int) -> str:
    """Their hparams file with the point's size, batch, length and vocabulary, one epoch (``max_steps`` ends it)."""
    overrides = {**SIZES[size], "vocab_size": vocab_size, "batch_size": point.batch_size, "max_length": point.max_len,
                 "epochs": 1}
    lines = []
    for line in their.splitlines():
        key = line.split(":", 1)[0].strip()
        lines.append(f"{key}: {overrides.pop(key)}" if key in overrides else line)
    return "\n".join(lines + [f"{k}: {v}" for k, v in overrides.items()]) + "\n"


# -- prepare ----------------------------------------------------------------------------------------------------------
def write_their_h5(path: Path, block: Any, width: int, vocab_size: int, seed: int) -> None:
    """``block``'s persons as their encoded_mlm.h5: rows padded to ``width``, masked by the seed's rules
    (``DynamicMasker``, epoch 0: the CLS task's reversed / shuffled events too), targets in their slot layout
    (``max_targets(width)`` targets from the front, unused ones position width-1 / token 0, then -1)."""
    import h5py
    import numpy as np
    import torch

    from lifeseq_shards.convert.sources.hdf5 import max_targets
    from lifeseq_shards.masking import DynamicMasker, MaskingConfig
    from tools.common import seed_rows

    masker, max_targets, n = DynamicMasker(MaskingConfig(vocab_size=vocab_size, seed=seed)), max_targets(width), block.n
    tmp = path.with_name(path.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        def dataset(name: str, shape: tuple[int, ...]) -> Any:
            return f.create_dataset(name, shape=shape, dtype="int64", chunks=(min(64, n), *shape[1:]),
                                    compression="gzip", compression_opts=4)

        out = {k: dataset(k, s) for k, s in (("input_ids", (n, 4, width)), ("padding_mask", (n, width)),
               ("original_sequence", (n, width)), ("sequence_id", (n,)), ("target_tokens", (n, width)),
               ("target_pos", (n, width)), ("target_cls", (n,)))}
        for start in range(0, n, 2048):
            stop = min(start + 2048, n)
            rows = seed_rows(block, start, stop, width)
            ids = torch.from_numpy(rows["input_ids"])
            m = masker.draw(*ids.unbind(1), torch.from_numpy(rows["padding_mask"]).sum(1),
                            torch.from_numpy(rows["sequence_id"]), 0)
            if m["target_pos"].shape[1] != max_targets:
                raise RuntimeError(
                    f"the masker keeps {m['target_pos'].shape[1]} target columns, their layout {max_targets}")
            tail = torch.full((stop - start, width - max_targets), -1)
            out["input_ids"][start:stop] = torch.stack(
                [m["masked_tokens"], m["abspos"], m["age"], m["segment"]], 1).numpy()
            out["padding_mask"][start:stop] = rows["padding_mask"]
            out["original_sequence"][start:stop] = m["original"].numpy()
            out["sequence_id"][start:stop] = rows["sequence_id"]
            out["target_pos"][start:stop] = torch.cat([m["target_pos"], tail], 1).numpy()
            out["target_tokens"][start:stop] = torch.cat([m["target_tokens"], tail], 1).numpy()
            out["target_cls"][start:stop] = m["target_cls"].numpy().astype(np.int64)
    tmp.rename(path)


def prepare_data(root: Path, persons: int, width: int, seed: int) -> None:
    """Synthetic persons -> their encoded_mlm.h5 -> shards (``root/shards``), each kept if already there."""
    from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
    from lifeseq_shards.convert.sources.synth import synth_population
    from lifeseq_shards.store.remote import read_manifest
    from tools.common import read_persons

    if (root / "shards" / "manifest.json").exists():
        return
    raw, plain = root / "raw", root / "plain"
    synth_population(raw, persons, seed, progress=False)
    opts = {"seed": seed, "overwrite": True, "progress": False, "max_seq_len": width}
    convert_dataset([str(raw / "sequences.parquet")], plain, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(num_val=0, **opts))
    (root / "vocab.csv").write_bytes((raw / "vocab.csv").read_bytes())
    write_their_h5(root / "encoded_mlm.h5", read_persons(plain), width, read_manifest(plain).vocab_size, seed)
    convert_dataset([str(root / "encoded_mlm.h5")], root / "shards", vocab=str(root / "vocab.csv"),
                    opts=ConvertOptions(num_val=NUM_VAL, gpus=1, **opts))
    for tmp in (raw, plain):
        subprocess.run(["rm", "-rf", str(tmp)], check=True)


def prepare(args: argparse.Namespace) -> None:
    from tools.seed_pretrain_check import their_copy

    work = Path(args.work)
    for name, patch in (("theirs", False), ("patched", True)):
        their_copy(Path(args.repo), args.commit, work / name, patch=patch, paths=THEIR_PATHS)
    for width in map(int, args.lengths.split(",")):
        t = time.perf_counter()
        persons = args.persons if width <= 512 else args.long_persons  # the 1,024-token points run at batch 64
        prepare_data(work / f"data-{width}", persons, width, args.seed)
        print(f"data-{width}: {persons} persons ({time.perf_counter() - t:.0f} s)", flush=True)


# -- run --------------------------------------------------------------------------------------------------------------
def point_config(work: Path, p: Point, run: Path) -> Path:
    """Their config.json and hparams file for ``p`` in ``run``."""
    data = work / f"data-{p.max_len}"
    their = (work / "theirs" / "pop2vec/llm/src/new_code/regular_hparams_small.txt").read_text()
    vocab_size = sum(1 for _ in open(data / "vocab.csv")) - 1  # their get_vocab_size: rows of the csv
    (run / "hparams.txt").write_text(hparams_text(their, p.size, p, vocab_size))
    cfg = {"CHECKPOINT_DIR": str(run / "ckpt"), "HPARAMS_PATH": str(run / "hparams.txt"),
           "VOCAB_PATH": str(data / "vocab.csv"), "NUM_VAL_ITEMS": NUM_VAL}
    cfg.update({"MLM_PATH": str(data / "encoded_mlm.h5")} if p.loader == "theirs" else
               {"SHARDS_PATH": str(data / "shards")})
    (run / "config.json").write_text(json.dumps(cfg, indent=1))
    return run / "config.json"


def run_point(args: argparse.Namespace, p: Point, index: int, timeout: float) -> dict[str, Any]:
    """``p`` in a process of its own; returns its row (the point's own, or a failed one from here)."""
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    run = Path(args.runs or out / "runs").resolve() / f"{index:02d}"
    run.mkdir(parents=True, exist_ok=True)
    row = {**asdict(p), "steps": args.steps, "warmup": args.warmup}
    copy = work / ("theirs" if p.loader == "theirs" else "patched")
    path = [str(REPO_ROOT), str(copy), *([str(Path(args.deps).resolve())] if args.deps else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    accelerator = "gpu" if args.plan == "gpu" else "cpu"
    cmd = [args.python, "-m", "tools.seed_bench_point", str(point_config(work, p, run)), str(out / "seed.jsonl"),
           json.dumps(row), "--", "--accelerator", accelerator, "--devices", "1"]
    before = count_lines(out / "seed.jsonl")
    t = time.perf_counter()
    with open(run / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                cwd=REPO_ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if count_lines(out / "seed.jsonl") > before:
        return json.loads((out / "seed.jsonl").read_text().splitlines()[-1])
    lines = (run / "log.txt").read_text().strip().splitlines() or [""]
    reason = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}: {lines[-1][:200]}"
    failed = {**row, "status": "failed", "reason": reason, "run_s": time.perf_counter() - t}
    with open(out / "seed.jsonl", "a") as f:
        f.write(json.dumps(failed) + "\n")
    return failed


def count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


COLUMNS = ("stack", "loader", "size", "max_len", "batch_size", "precision", "attention", "kernel", "status",
           "persons_per_s", "tokens_per_s", "step_time_s", "data_wait_frac", "device_gap_frac", "peak_mem_mb", "run_s")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, with shards / theirs persons/s beside each shards row of a pair."""
    theirs = {tuple(r[k] for k in COLUMNS[:7] if k != "loader"): r for r in rows if r["loader"] == "theirs"}

    def cell(r: dict[str, Any], k: str) -> str:
        v = r.get(k, r.get("reason", "") if k == "kernel" else "")
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join((*COLUMNS, "after / before")) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for r in rows:
        mate = theirs.get(tuple(r[k] for k in COLUMNS[:7] if k != "loader")) if r["loader"] == "shards" else None
        ratio = (f"{r['persons_per_s'] / mate['persons_per_s']:.2f}x" if mate and "persons_per_s" in r
                 and "persons_per_s" in mate else "")
        lines.append("| " + " | ".join([*(cell(r, k) for k in COLUMNS), ratio]) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for i, p in enumerate(plan(args.plan, args.stack)):
        left = args.budget_s - (time.perf_counter() - start)
        if left < args.min_point_s:  # no point starts that could not finish
            print(f"budget of {args.budget_s:.0f} s spent: {len(plan(args.plan, args.stack)) - i} points left",
                  flush=True)
            break
        row = run_point(args, p, i, min(args.point_timeout_s, left))
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "seed.md").write_text(table(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="their code and the data, into --work")
    prep.add_argument("repo", help="their repository: a clone or a bare mirror")
    prep.add_argument("--commit", default="884ef02")
    prep.add_argument("--work", required=True)
    prep.add_argument("--persons", type=int, default=6000)
    prep.add_argument("--long-persons", type=int, default=2000, help="persons at lengths over 512")
    prep.add_argument("--lengths", default="512,1024")
    prep.add_argument("--seed", type=int, default=0)
    go = sub.add_parser("run", help="the plan's points, each in a process of its own")
    go.add_argument("--work", required=True, help="what `prepare` made")
    go.add_argument("--out", required=True)
    go.add_argument("--runs", default=None, help="each point's config and log (default OUT/runs)")
    go.add_argument("--plan", choices=("gpu", "cpu"), default="gpu")
    go.add_argument("--python", default=sys.executable, help="the stack to time (default: this Python)")
    go.add_argument("--stack", default="newest", help="its name in the rows")
    go.add_argument("--deps", default=None, help="a directory with what their code imports that PY lacks")
    go.add_argument("--steps", type=int, default=15)
    go.add_argument("--warmup", type=int, default=5)
    go.add_argument("--budget-s", type=float, default=240)
    go.add_argument("--point-timeout-s", type=float, default=60)
    go.add_argument("--min-point-s", type=float, default=15, help="start no point with less time left")
    args = p.parse_args()
    prepare(args) if args.command == "prepare" else run(args)


if __name__ == "__main__":
    main()
