"""Training throughput sweep: model size x max length x batch size x precision x torch.compile x attention (padded or
padding-free varlen) x device-side prefetch (x loader workers, pinned memory), each point a short Lightning run of
lifeseq_shards.model on the real LifeSeqDataModule.

Per point: real (non-padding) tokens/s, samples/s, step time, the share of the step the host spends blocked on the
loader and the device's gap between steps, the host's time inside the step by phase (forward, backward, optimizer),
peak memory, and MFU on real tokens and on computed slots against a matmul ceiling measured on this device first.
Writes results.csv, results.md and PNG plots into --out; docs/results/training-gpu.md reads them.

    python -m tools.train_bench --preset cpu --out docs/results/cpu-DATE
    python -m tools.train_bench --preset gpu --out results-gpu    # one H200: about 9 minutes, see PRESETS
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import platform
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import click
import lightning as L
import torch
from tqdm import tqdm

from lifeseq_shards.datamodule import LifeSeqDataModule
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import LifeSeqPretrainModule, model_flops_per_token, resolve_size
from lifeseq_shards.store.remote import read_manifest
from tools.common import synth_dataset, write_csv
from tools.meter import HOST_PHASES, StepMeter, peak_memory_mb, reset_peak_memory, sync

PRECISIONS = ("32-true", "tf32", "bf16-mixed")
ATTENTION = ("padded", "varlen")
MASKERS = ("eager", "compiled", "graphed")
CEILING_DTYPE = {"32-true": "fp32", "tf32": "tf32", "bf16-mixed": "bf16"}


@dataclass(frozen=True)
class Point:
    size: str
    max_len: int
    batch_size: int
    precision: str
    compile: bool
    workers: int
    pin_memory: bool = True
    attention: str = "padded"  # "varlen": the packed layout, attention per person (lifeseq_shards.model.Packed)
    prefetch: bool = False  # the next batch built on a side CUDA stream (prefetch.DevicePrefetcher)
    prefetch_thread: bool = False  # ... launched from a background thread (prefetch="thread")
    masker: str = "eager"  # DynamicMasker's launch: "eager", "compiled" (torch.compile) or "graphed" (CUDA graphs)
    tokens_per_batch: int = 0  # 0: batches of batch_size persons; else training batches of this token budget a GPU


@dataclass(frozen=True)
class Preset:
    """A union of grids (each a cross product), so costly axes (compile, workers) are only crossed where useful."""

    grids: tuple[dict[str, tuple], ...]
    steps: int
    warmup: int
    people: int
    budget_s: float  # points left when this is spent are skipped with that reason
    max_seq_len: int = 512  # the converter's cap for the synthesised data (--data replaces it)

    def points(self) -> list[Point]:
        out: list[Point] = []
        for grid in self.grids:
            keys = list(grid)
            for values in itertools.product(*(grid[k] for k in keys)):
                p = Point(**dict(zip(keys, values, strict=True)))
                if p not in out:
                    out.append(p)
        return out


def _grid(sizes, lengths, batches, precisions=("32-true",), compile=(False,), workers=(2,), pin=(True,),
          attention=("padded",), prefetch=(False,), prefetch_thread=(False,), masker=("eager",),
          tokens=(0,)) -> dict:
    return {"size": sizes, "max_len": lengths, "batch_size": batches, "precision": precisions, "compile": compile,
            "workers": workers, "pin_memory": pin, "attention": attention, "prefetch": prefetch,
            "prefetch_thread": prefetch_thread, "masker": masker, "tokens_per_batch": tokens}


PRESETS: dict[str, Preset] = {
    # tests: both attention modes, a few steps; prefetch (and its thread) through its CPU path.
    "tiny": Preset((_grid(("small",), (128,), (4,), workers=(1,), attention=("padded", "varlen")),
                    _grid(("small",), (128,), (2,), workers=(1,), attention=("varlen",), prefetch=(True,),
                          prefetch_thread=(False, True))),
                   steps=4, warmup=1, people=300, budget_s=300),
    # a 2-core CPU: about 5 minutes (medium and large are GPU-only here: a medium step at batch 16 takes ~30 s).
    "cpu": Preset(
        (
            _grid(("small", "small-tc"), (128,), (4, 16), workers=(1,)),
            _grid(("small",), (128,), (16,), ("bf16-mixed",), workers=(1,)),
            _grid(("small",), (128,), (16,), workers=(0, 2)),
            _grid(("small",), (128,), (4,), compile=(True,), workers=(1,)),
        ),
        steps=4, warmup=1, people=1000, budget_s=360,
    ),
    # one H200: the first 18 points took 240 s (large fp32 at batch 256 alone ~45 s); the rest about as long.
    # The budget skips what does not fit; --resume runs only the points not yet measured.
    "gpu": Preset(
        (
            _grid(("small", "small-tc"), (512,), (64, 256), PRECISIONS),
            _grid(("small-tc",), (512,), (256,), ("bf16-mixed",), workers=(1, 4, 8), pin=(True,)),
            _grid(("small-tc",), (512,), (256,), ("bf16-mixed",), pin=(False,)),
            _grid(("large", "large-tc"), (512,), (64, 256), PRECISIONS),
            _grid(("medium", "medium-tc"), (128, 256), (256,), ("bf16-mixed",)),
            _grid(("small-tc", "large-tc"), (512,), (256,), ("bf16-mixed",), compile=(True,)),
        ),
        steps=30, warmup=5, people=20000, budget_s=540,
    ),
    # the padding-free step's bars (docs/results/training-gpu.md), most important first (tools/device_check.sh; the
    # budget drops what does not fit): bf16, L=512, batch 256; the old path (padded, no prefetch) against the
    # padding-free one in the same run.
    "varlen": Preset(
        tuple(_grid((size,), (512,), (256,), ("bf16-mixed",), compile=(comp,), attention=(attn,), prefetch=(pre,))
              for size, attn, pre, comp in (
                  ("large-tc", "padded", False, False), ("large-tc", "varlen", True, False),
                  ("small-tc", "padded", False, False), ("small-tc", "varlen", True, False),
                  ("large-tc", "varlen", True, True),
                  ("small-tc", "varlen", False, False), ("small-tc", "padded", True, False),
                  ("small-tc", "varlen", True, True),
                  ("large", "varlen", True, False), ("small", "varlen", True, False),  # the seed's head dims
                  ("large-tc", "padded", False, True), ("large-tc", "varlen", False, False),
              )),
        steps=40, warmup=5, people=20000, budget_s=200,
    ),
    # the small-tc bars after two runs missed them (host-bound step): the reference, then the padding-free step
    # with the host-cost levers, most decisive first (tools/device_check.sh small): the CUDA-graphed masker with the
    # compiled model, and in a thread, then with the eager model; the compiled masker; the eager (fewer-launch)
    # masker as in the second run.
    "small": Preset(
        tuple(_grid(("small-tc",), (512,), (256,), ("bf16-mixed",), compile=(comp,), attention=(attn,),
                    prefetch=(pre,), prefetch_thread=(thread,), masker=(masker,))
              for attn, pre, thread, comp, masker in (
                  ("padded", False, False, False, "eager"), ("varlen", True, False, True, "graphed"),
                  ("varlen", True, True, True, "graphed"), ("varlen", True, True, False, "graphed"),
                  ("varlen", True, False, False, "graphed"), ("varlen", True, False, True, "compiled"),
                  ("varlen", True, False, True, "eager"), ("varlen", True, False, False, "eager"),
              )),
        steps=40, warmup=5, people=20000, budget_s=120,
    ),
    # the researchers' BERT-base-sized model (D3-hparams-large.txt) at their batch of 50, L=512 and 1,024, each
    # precision, padded and padding-free (with prefetch); data converted with --max-seq-len 1024, which the 512
    # points crop. 1,024 first: the length they train at.
    "base": Preset(
        tuple(_grid(("base",), (length,), (50,), PRECISIONS, attention=(attn,), prefetch=(attn == "varlen",))
              for length in (1024, 512) for attn in ("padded", "varlen")),
        steps=20, warmup=5, people=20000, budget_s=240, max_seq_len=1024,
    ),
    # token-budget batches against batches of persons (tools/device_check.sh tokens): bf16, small-tc and large-tc at
    # L=512 (256 persons, or the tokens 256 mean persons hold: ~60,000 of the synthetic lengths), padded, padding-free
    # by persons, then padding-free by tokens eager and compiled with the CUDA-graphed masker (static shapes).
    "tokens": Preset(
        tuple(_grid((size,), (512,), (256,), ("bf16-mixed",), compile=(comp,), attention=(attn,), prefetch=(pre,),
                    masker=(masker,), tokens=(tok,))
              for size in ("small-tc", "large-tc")
              for attn, pre, comp, masker, tok in (
                  ("padded", False, False, "eager", 0), ("varlen", True, False, "eager", 0),
                  ("varlen", True, False, "eager", 60000), ("varlen", True, True, "graphed", 60000),
              )),
        steps=40, warmup=5, people=20000, budget_s=240,
    ),
    # training speed as a function of batch size: the small models' step is launch-bound at 256
    # (docs/results/training-gpu.md),
    # so the batch is the first lever; up to what memory allows (an OOM point is a row with its reason). bf16, L=512,
    # the padding-free step with prefetch, then padded; the seed's shapes and the -tc twins. On 20,000 persons the
    # largest batches cross epoch boundaries inside the measured steps (their restarts show in data_wait_frac).
    "batch": Preset(
        tuple(_grid((size,), (512,), (256, 512, 1024, 2048, 4096), ("bf16-mixed",), attention=(attn,),
                    prefetch=(attn == "varlen",))
              for attn, sizes in (("varlen", ("small-tc", "small", "medium-tc", "medium")),
                                  ("padded", ("small-tc", "small")))
              for size in sizes),
        steps=12, warmup=3, people=20000, budget_s=240,
    ),
}


def measure_matmul_ceiling(device: torch.device, kind: str, n: int, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of an n x n matmul in `kind` (fp32 | tf32 | bf16): the MFU denominator."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        sync(device)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            reps += 1
            if reps % 8 == 0:
                sync(device)
        sync(device)
        return 2 * n**3 * reps / (time.perf_counter() - t0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def measure_ceilings(device: torch.device, precisions: set[str]) -> dict[str, float]:
    n = 8192 if device.type == "cuda" else 1024
    kinds = {CEILING_DTYPE[p] for p in precisions if not (p == "tf32" and device.type != "cuda")}
    return {k: measure_matmul_ceiling(device, k, n) for k in sorted(kinds)}


def skip_reason(p: Point, device: torch.device) -> str | None:
    """Why a point cannot run here, or None."""
    if p.precision == "tf32" and device.type != "cuda":
        return "tf32 is a CUDA matmul mode (on CPU it is 32-true)"
    if p.precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16"
    if p.pin_memory is False and device.type != "cuda":
        return "pinned memory only matters with a GPU"
    if p.prefetch_thread and not p.prefetch:
        return "prefetch_thread needs prefetch"
    return None


def run_point(p: Point, data_dir: Path, vocab_size: int, steps: int, warmup: int, seed: int,
              device: torch.device, ceilings: dict[str, float]) -> dict[str, Any]:
    """One short fit; returns the measured row (or raises, for the caller to record as a skip)."""
    torch.set_float32_matmul_precision("high" if p.precision == "tf32" else "highest")
    masking = MaskingConfig(kind="random", vocab_size=vocab_size, seed=seed)
    dm = LifeSeqDataModule(
        data_dir, p.batch_size, num_workers=p.workers, seed=seed, pad_to=p.max_len,
        masking=DynamicMasker(masking, p.masker),
        pin_memory=p.pin_memory, persistent_workers=p.workers > 0,
        layout="packed" if p.attention == "varlen" else "padded",
        prefetch="thread" if p.prefetch_thread else p.prefetch,  # the results' two columns, as one choice
        tokens_per_batch=p.tokens_per_batch or None,
    )
    module = LifeSeqPretrainModule(p.size, vocab_size, compile=p.compile)
    meter = StepMeter(warmup)
    n_dev = torch.cuda.device_count() if device.type == "cuda" else 1
    trainer = L.Trainer(
        accelerator="auto", devices="auto", strategy="ddp" if n_dev > 1 else "auto", max_steps=steps,
        precision="32-true" if p.precision == "tf32" else p.precision, callbacks=[meter], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    reset_peak_memory(device)
    trainer.fit(module, datamodule=dm)
    if not meter.totals:
        raise RuntimeError(f"the loader ended after {meter.steps} measured steps; use more --people")
    elapsed = meter.t1 - meter.t0
    real, len_sq, targets = meter.totals
    world = trainer.world_size
    cfg = resolve_size(p.size)
    fpt = model_flops_per_token(cfg, len_sq / real, vocab_size, targets / real)
    ceiling = ceilings.get(CEILING_DTYPE[p.precision], math.nan) * world
    slots = meter.padded * world
    # computed slots: padded, every slot runs the layers and attends to all L keys (the mask only zeroes weights)
    slot_fpt = model_flops_per_token(cfg, meter.attended / slots if meter.attended else len_sq / real, vocab_size,
                                      targets / slots)
    return {
        "world": world,
        "steps": meter.steps,
        "step_time_s": elapsed / meter.steps,
        "tokens_per_s": real / elapsed,
        "samples_per_s": meter.samples * world / elapsed,
        "data_wait_frac": meter.wait / elapsed,
        "device_gap_frac": meter.device_gap / elapsed,
        "peak_mem_mb": peak_memory_mb(device),
        "real_tokens": int(real),
        "padded_tokens": meter.padded * world,
        "pad_frac": 1 - real / (meter.padded * world),
        "gflop_per_token": fpt / 1e9,
        "mfu": real / elapsed * fpt / ceiling,
        "mfu_slots": slots / elapsed * slot_fpt / ceiling,
        **{f"host_{phase}_ms": seconds / meter.steps * 1e3 for phase, seconds in meter.host.items()},
    }


RESULT_KEYS = ("status", "reason", "world", "steps", "step_time_s", "tokens_per_s", "samples_per_s",
               "data_wait_frac", "device_gap_frac", "peak_mem_mb", "real_tokens", "padded_tokens", "pad_frac",
               "gflop_per_token", "mfu", "mfu_slots", *(f"host_{phase}_ms" for phase in HOST_PHASES))


def write_results(rows: list[dict[str, Any]], path: Path) -> None:
    write_csv(path, rows, [f.name for f in fields(Point)] + list(RESULT_KEYS))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def write_markdown(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    cols = ["size", "max_len", "batch_size", "precision", "compile", "attention", "prefetch", "prefetch_thread",
            "masker", "workers", "pin_memory",
            "tokens_per_s", "samples_per_s", "step_time_s", "data_wait_frac", "device_gap_frac", "peak_mem_mb", "mfu",
            "mfu_slots", "pad_frac", "status"]
    lines = ["# train_bench results", "", "```", json.dumps(env, indent=1), "```", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_fmt(r.get(c, "")) for c in cols]
        if r["status"] != "ok":
            cells[-1] = f"{r['status']}: {r['reason']}"
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """tokens/s and data-wait share vs batch size: one panel per (size, max_len), one line per run setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    panels = sorted({(r["size"], r["max_len"]) for r in ok})
    written = []
    shares = ("data_wait_frac", "device_gap_frac")
    for metric, label in (("tokens_per_s", "real tokens / s"), ("data_wait_frac", "host's share of step between steps"),
                          ("device_gap_frac", "device's share of step between steps")):
        cols = min(4, max(1, len(panels)))
        nrows = max(1, -(-len(panels) // cols))
        fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
        for ax, (size, max_len) in zip(axes.flat, panels, strict=False):
            here = [r for r in ok if (r["size"], r["max_len"]) == (size, max_len)]
            setting = ("precision", "compile", "workers", "pin_memory", "attention", "prefetch", "prefetch_thread",
                       "masker")
            for key in sorted({tuple(r[k] for k in setting) for r in here}):
                line = sorted((r["batch_size"], r[metric]) for r in here if tuple(r[k] for k in setting) == key)
                prec, comp, work, pin, attn, pre, thread, masker = key
                name = (f"{prec}{' compiled' if comp else ''} w{work}{'' if pin else ' unpinned'}"
                        f"{' varlen' if attn == 'varlen' else ''}{' prefetch' if pre else ''}"
                        f"{' thread' if thread else ''}{' masker compiled' if masker == 'compiled' else ''}")
                ax.plot(*zip(*line, strict=True), marker="o", label=name)
            ax.set_title(f"{size}, L={max_len}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(label)
            if metric in shares:
                ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def environment(device: torch.device, ceilings: dict[str, float], preset: str, steps: int, warmup: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__, "lightning": L.__version__,
            "preset": preset, "steps": steps, "warmup": warmup,
            "matmul_ceiling_tflops": {k: round(v / 1e12, 3) for k, v in ceilings.items()},
            "date": time.strftime("%Y-%m-%d")}


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of an earlier results.csv, typed again (numbers as numbers, flags as bools, blanks as NaN)."""
    kinds = {f.name: f.type for f in fields(Point)}
    rows = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in raw.items():
                if kinds.get(k) == "bool":
                    row[k] = v == "True"
                elif kinds.get(k) == "int" or (k in ("world", "steps", "real_tokens", "padded_tokens") and v):
                    row[k] = int(v)
                elif k in ("status", "reason") or kinds.get(k) == "str":
                    row[k] = v
                else:
                    row[k] = float(v) if v else math.nan
            defaults = {f.name: f.default for f in fields(Point) if f.name not in row}  # axes added since that run
            rows.append({**{k: math.nan for k in RESULT_KEYS}, **defaults, **row})  # results added since: NaN
    return rows


def run_sweep(points: list[Point], data_dir: Path, out: Path, steps: int, warmup: int, budget_s: float,
              seed: int = 0, preset: str = "custom", done: list[dict[str, Any]] | None = None,
              plots: bool = True) -> list[dict[str, Any]]:
    """Runs each point not already among the ok rows of `done` (an earlier, interrupted sweep), in order."""
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    vocab_size = read_manifest(data_dir).vocab_size
    ceilings = measure_ceilings(device, {p.precision for p in points})
    lead = int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0
    start = time.perf_counter()
    rows = []
    kept = {Point(**{f.name: r[f.name] for f in fields(Point)}): r for r in done or [] if r["status"] == "ok"}
    for p in tqdm(points, desc="train_bench", unit="point"):
        if p in kept:
            rows.append(kept[p])
            continue
        row: dict[str, Any] = {**asdict(p), "status": "ok", "reason": ""}
        reason = skip_reason(p, device)
        if reason is None and time.perf_counter() - start > budget_s:
            reason = f"time budget of {budget_s:.0f} s spent"
        if reason is None:
            try:
                row.update(run_point(p, data_dir, vocab_size, steps, warmup, seed, device, ceilings))
            except Exception as e:  # a point that cannot run (OOM, a kernel or compile error) is a row, not a crash:
                traceback.print_exc()  # one broken point must not cost a one-shot GPU sweep its remaining points
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if reason is not None:
            row.update(status="skipped", reason=reason)
        rows.append(row)
        if lead:  # after every point, so a sweep stopped by a time limit still leaves its rows
            write_results(rows, out / "results.csv")
            write_markdown(rows, environment(device, ceilings, preset, steps, warmup), out / "results.md")
    if lead and plots:
        plot(rows, out)
    return rows


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="results directory")
@click.option("--data", type=click.Path(path_type=Path, exists=True), default=None,
              help="a converted dataset (default: synthesise the preset's number of people into OUT/data)")
@click.option("--sizes", default=None, help="comma list; with the options below, replaces the preset's grids")
@click.option("--lengths", default=None, help="comma list of max lengths (pad_to)")
@click.option("--batch-sizes", default=None, help="comma list")
@click.option("--precisions", default=None, help=f"comma list of {', '.join(PRECISIONS)}")
@click.option("--compile", "compile_", type=click.Choice(["off", "on", "both"]), default=None)
@click.option("--workers", default=None, help="comma list of loader workers per GPU")
@click.option("--attention", default=None, help="comma list of padded, varlen (packed layout, attention per person)")
@click.option("--prefetch", type=click.Choice(["off", "on", "both"]), default=None,
              help="build the next batch on a side CUDA stream during the step")
@click.option("--prefetch-thread", type=click.Choice(["off", "on", "both"]), default=None,
              help="launch the prefetch's preparation from a background thread")
@click.option("--masker", default=None, help="comma list of eager, compiled (torch.compile), graphed (CUDA graphs): "
              "DynamicMasker's launch")
@click.option("--tokens-per-batch", "tokens", default=None,
              help="comma list of token budgets a GPU a step (0: batches of --batch-sizes persons)")
@click.option("--steps", type=int, default=None)
@click.option("--warmup", type=int, default=None)
@click.option("--budget-s", type=float, default=None, help="skip the points left after this many seconds")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--resume", is_flag=True, help="keep the ok rows of OUT/results.csv; run only the other points")
@click.option("--plots/--no-plots", default=True, show_default=True, help="the PNGs (off: only results.csv/.md)")
def main(preset: str, out: Path, data: Path | None, sizes: str | None, lengths: str | None, batch_sizes: str | None,
         precisions: str | None, compile_: str | None, workers: str | None, attention: str | None,
         prefetch: str | None, prefetch_thread: str | None, masker: str | None, tokens: str | None, steps: int | None,
         warmup: int | None, budget_s: float | None, seed: int, resume: bool, plots: bool) -> None:
    """Sweep training throughput; each option given replaces that axis in every grid of the preset."""
    pre = PRESETS[preset]
    overrides = {
        "size": sizes and tuple(sizes.split(",")),
        "max_len": lengths and tuple(int(x) for x in lengths.split(",")),
        "batch_size": batch_sizes and tuple(int(x) for x in batch_sizes.split(",")),
        "precision": precisions and tuple(precisions.split(",")),
        "compile": compile_ and {"off": (False,), "on": (True,), "both": (False, True)}[compile_],
        "workers": workers and tuple(int(x) for x in workers.split(",")),
        "attention": attention and tuple(attention.split(",")),
        "prefetch": prefetch and {"off": (False,), "on": (True,), "both": (False, True)}[prefetch],
        "prefetch_thread": prefetch_thread and {"off": (False,), "on": (True,), "both": (False, True)}[prefetch_thread],
        "masker": masker and tuple(masker.split(",")),
        "tokens_per_batch": tokens and tuple(int(x) for x in tokens.split(",")),
    }
    grids = tuple({**g, **{k: v for k, v in overrides.items() if v}} for g in pre.grids)
    for axis, known in (("precision", PRECISIONS), ("attention", ATTENTION), ("masker", MASKERS)):
        if bad := sorted({x for g in grids for x in g[axis]} - set(known)):
            raise click.BadParameter(f"unknown {axis} {bad}: one of {', '.join(known)}")
    pre = Preset(grids, steps or pre.steps, warmup or pre.warmup, pre.people, budget_s or pre.budget_s,
                 pre.max_seq_len)
    data_dir = data or synth_dataset(out / "data", pre.people, seed, pre.max_seq_len)
    for noise in (".*does not have many workers.*", ".*no `validation_step`.*"):
        warnings.filterwarnings("ignore", noise)
    done = read_csv(out / "results.csv") if resume and (out / "results.csv").exists() else []
    rows = run_sweep(pre.points(), data_dir, out, pre.steps, pre.warmup, pre.budget_s, seed, preset, done, plots)
    ok = sum(r["status"] == "ok" for r in rows)
    click.echo(f"{ok}/{len(rows)} points ran; results in {out}")


if __name__ == "__main__":
    main()
