"""Static shapes for token-budget batches: how often the reference training step compiles over an epoch, what the
compiles cost, and the step rate, eager against ``torch.compile``, each batch as the budget makes it (varying)
against the same batches padded to one ``device.shape.StaticShape`` (static).

The batches: one token-budget epoch of a split (``plan.balance.plan_epoch``, one rank, no DataLoader worker, over
``store.lengths.split_lengths``), each batch collated from the split's blocks (``reader.collate.collate``), the
model batches built once before timing (packed layout, the longest person's width rounded up to 8, dynamic
masking). The static shape: the budget's tokens and ``plan.balance.person_rows`` of the same lengths. The step:
``LifeSeqPretrainModule.training_step`` (MLM + CLS), backward, AdamW, on CPU, a tiny width (compiles and host costs
are measured, not the model's speed). Each contender starts from the same weights after ``torch._dynamo.reset()``;
each compiles cold (a new inductor cache folder; the process's in-memory cache of identical kernels aside);
compiles are dynamo's own count (``counters["stats"]["unique_graphs"]``), a step that compiled is one during which
the count grew, its compile time its wall time over the median of the steps that did not compile. The losses of the
static and the varying batches are checked to agree step by step.

    python -m tools.bench_static --out docs/results

(``--sample``: the sample to convert, by default the copy tests/data/lifeseq-sample carries; ``--data``: a dataset
already converted.)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.device.batch import ModelBatch, PackedBatch
from lifeseq_shards.device.build import BatchBuilder, count_tokens
from lifeseq_shards.device.shape import PACKED, StaticShape
from lifeseq_shards.encoder import EncoderConfig
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import LifeSeqPretrainModule
from lifeseq_shards.plan.balance import person_rows, plan_epoch
from lifeseq_shards.plan.resume import Arrangement
from lifeseq_shards.reader.collate import BatchSpec, collate
from lifeseq_shards.store.format import concat_blocks, token_schema
from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest
from lifeseq_shards.store.shardfile import read_shard_blocks
from tools.common import REPO, write_csv

SAMPLE = REPO / "tests" / "data" / "lifeseq-sample"  # the sample carried in this repository

TINY = EncoderConfig(64, 128, 2, 4)  # the compiler's work and the host's, not the model's FLOPs, are measured
CONTENDERS = (("eager", "varying"), ("eager", "static"), ("compiled", "varying"), ("compiled", "static"))


def budget_batches(ours: Path, split: str, tokens_per_batch: int, *, seed: int = 0, epoch: int = 0,
                   steps: int | None = None) -> tuple[list[PackedBatch], StaticShape, int]:
    """The host batches of one token-budget epoch of ``split`` of the dataset ``ours`` (one rank, no worker; its
    first ``steps`` only, when given), packed and counted for the width; the :class:`StaticShape` sized from the
    same lengths and budget; and that width, the longest person rounded up to a multiple of 8 (no person cropped)."""
    manifest = read_manifest(ours)
    lengths, sizes = split_lengths(str(ours), manifest, split)
    plan = plan_epoch(lengths, sizes, Arrangement.of_budget(tokens_per_batch, 1, 0), seed=seed, epoch=epoch)
    schema = token_schema(manifest.schema)  # read_shard_blocks repeats the stamps over their tokens
    # the split's persons in the plan's numbering: its shards in manifest order, then the remainder
    block = concat_blocks([b for e in manifest.splits[split].entries()
                           for b in read_shard_blocks(Path(ours) / e.file, manifest.schema)], schema)
    width = -(-int(lengths.max()) // 8) * 8
    spec = BatchSpec(schema, packed=True)
    batches = [count_tokens(collate(block, spec, plan.batch(s, 0)), width)
               for s in range(plan.steps if steps is None else min(steps, plan.steps))]
    return batches, StaticShape(tokens_per_batch, person_rows(lengths, tokens_per_batch)), width


def model_batches(batches: list[PackedBatch], vocab_size: int, width: int,
                  static: StaticShape | None) -> list[ModelBatch]:
    """The packed model batches of ``batches`` on the CPU, dynamic masks of epoch 0, padded to ``static`` if given."""
    builder = BatchBuilder(DynamicMasker(MaskingConfig(vocab_size=vocab_size)), PACKED, width, static)
    return [builder(b, "cpu", 0) for b in batches]


def pretrain_module(vocab_size: int, backend: str | None, cfg: EncoderConfig = TINY) -> LifeSeqPretrainModule:
    """The reference module with seeded weights (the same for every contender), no dropout; its encoder compiled
    with ``backend`` (None: eager)."""
    torch.manual_seed(0)
    module = LifeSeqPretrainModule(cfg, vocab_size, dropout=0.0, compile=backend is not None)
    if backend is not None and backend != "inductor":
        module.encoder.compile(backend=backend)  # the module's own compile is inductor's; replaced before any call
    return module


def train_step(module: LifeSeqPretrainModule, optimizer: torch.optim.Optimizer, batch: ModelBatch, i: int) -> float:
    """One step of ``module`` (its ``training_step``: MLM + CLS, outside a Trainer) on ``batch`` (step ``i``),
    backward and ``optimizer``; the loss."""
    with warnings.catch_warnings():  # no Trainer: training_step's self.log() says so and logs nothing
        warnings.filterwarnings("ignore", message=".*self.log.*")
        loss = module.training_step(batch, i)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def compiles() -> int:
    """The graphs dynamo compiled since the last ``counters.clear()``."""
    return int(counters["stats"]["unique_graphs"])


def run_epoch(batches: list[ModelBatch], vocab_size: int, backend: str | None,
              cfg: EncoderConfig = TINY) -> dict[str, Any]:
    """The steps over ``batches`` of the module of size ``cfg`` from fresh weights and a fresh dynamo: losses, each
    step's seconds, the compiles and the steps during which dynamo compiled."""
    torch._dynamo.reset()
    counters.clear()
    module = pretrain_module(vocab_size, backend, cfg)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    losses, seconds, compiled_at = [], [], []
    for i, batch in enumerate(batches):
        before = compiles()
        start = time.perf_counter()
        losses.append(train_step(module, optimizer, batch, i))
        seconds.append(time.perf_counter() - start)
        if compiles() > before:
            compiled_at.append(i)
    return {"losses": losses, "seconds": seconds, "compiles": compiles(), "compiled_at": compiled_at}


def summary(mode: str, shapes: str, run: dict[str, Any], tokens: int) -> dict[str, Any]:
    """One table row of a :func:`run_epoch`: ``tokens``, the epoch's real tokens."""
    seconds, at = run["seconds"], set(run["compiled_at"])
    steady = [s for i, s in enumerate(seconds) if i not in at]
    typical = statistics.median(steady) if steady else float("nan")
    return {"mode": mode, "shapes": shapes, "steps": len(seconds), "compiles": run["compiles"],
            "compiling_steps": len(at), "compile_s": round(sum(seconds[i] - typical for i in at), 2),
            "epoch_s": round(sum(seconds), 2), "steady_steps_per_s": round(1 / typical, 2),
            "epoch_steps_per_s": round(len(seconds) / sum(seconds), 2),
            "real_tokens_per_s": round(tokens / sum(seconds))}


def measure(ours: Path, split: str, tokens_per_batch: int, steps: int | None, backend: str) -> dict[str, Any]:
    """Every contender of :data:`CONTENDERS` over the same epoch: the rows, and the batches' sizes."""
    manifest = read_manifest(ours)
    assert manifest.vocab_size is not None, f"{ours}: converted without --vocab; dynamic masking needs its size"
    batches, static, width = budget_batches(ours, split, tokens_per_batch, steps=steps)
    built = {"varying": model_batches(batches, manifest.vocab_size, width, None),
             "static": model_batches(batches, manifest.vocab_size, width, static)}
    tokens = sum(b.n_tokens or 0 for b in batches)
    runs = {}
    with tempfile.TemporaryDirectory() as caches:
        for mode, shapes in CONTENDERS:
            # a cold compile each: inductor's disk cache (kept across runs and processes) is a new folder
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, f"{mode}-{shapes}")
            runs[mode, shapes] = run_epoch(built[shapes], manifest.vocab_size,
                                           backend if mode == "compiled" else None)
    for mode in ("eager", "compiled"):  # padding changes no loss (fp32 sums in another order: a little slack)
        torch.testing.assert_close(torch.tensor(runs[mode, "static"]["losses"]),
                                   torch.tensor(runs[mode, "varying"]["losses"]), rtol=1e-4, atol=1e-4)
    persons = [len(b.lengths) for b in built["varying"]]
    return {"rows": [summary(m, s, runs[m, s], tokens) for m, s in CONTENDERS],
            "batches": {"steps": len(batches), "persons_min": min(persons), "persons_max": max(persons),
                        "persons_mean": sum(persons) / len(persons), "real_tokens": tokens,
                        "tokens_min": min(b.n_tokens or 0 for b in batches),
                        "tokens_max": max(b.n_tokens or 0 for b in batches),
                        "static": static, "rows": static.rows(width), "width": width}}


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    """docs/results/static-shapes.md: the method (this module's docstring), the batches and the table."""
    b = result["batches"]
    rows = {(r["mode"], r["shapes"]): r for r in result["rows"]}

    def ratio(mode: str) -> str:
        return f"{rows[mode, 'varying']['steady_steps_per_s'] / rows[mode, 'static']['steady_steps_per_s']:.2f} x"

    cols = list(result["rows"][0])
    table = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    table += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in result["rows"]]
    return "\n".join([
        "# Static shapes for token-budget batches", "",
        __doc__.split("\n\n    python")[0].strip(), "",
        f"Run: `python -m tools.bench_static --tokens-per-batch {args.tokens_per_batch} --steps {args.steps} "
        f"--backend {args.backend}` on {time.strftime('%Y-%m-%d')}, {platform.machine()} CPU, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, the sample's {args.split} split "
        f"({'given data' if args.data else 'encoded_nomlm.h5 converted with vocab.csv'}).", "",
        f"Batches: {b['steps']} steps of {b['persons_min']}-{b['persons_max']} persons and {b['tokens_min']}-"
        f"{b['tokens_max']} real tokens (budget {args.tokens_per_batch}); static: {b['static']}, "
        f"{b['rows']} person rows (with the padding persons) at width {b['width']}.", "",
        *table, "",
        f"Ratios of this run: a static step over a varying one (median steps that did not compile) {ratio('eager')} "
        f"eager, {ratio('compiled')} compiled; compile time, static over varying, "
        f"{rows['compiled', 'static']['compile_s'] / max(rows['compiled', 'varying']['compile_s'], 1e-9):.2f}. "
        f"The static batches' token positions are {100 * b['real_tokens'] / (b['steps'] * b['static'].tokens):.0f} % "
        f"real, and they have {b['rows']} person rows where the batches hold {b['persons_mean']:.1f} persons on "
        f"average: {b['rows'] / b['persons_mean']:.1f} x the work that goes by person rows (on this CPU backend the "
        "padded attention's width slots a row, where FlashAttention's varlen kernel spends nothing on a person "
        "without tokens; the masker's (rows, width) draw too, outside the timed step here). The MLM head reads "
        "floor(0.3 x tokens) target columns a static batch, against floor(0.3 x width) a person unpadded.",
        "",
        "compiles: graphs dynamo compiled (forward and its backward count once); compile_s: the wall time of the "
        "steps that compiled over the median step's; steady_steps_per_s: 1 / the median step that did not compile; "
        "epoch_steps_per_s and real_tokens_per_s: over the whole epoch, compiles included.", ""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, help="a converted dataset with a vocabulary (else --sample is converted)")
    p.add_argument("--sample", type=Path, default=SAMPLE,
                   help="the sample to convert (default: the copy this repository carries)")
    p.add_argument("--split", default="train")
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=24, help="the epoch's first steps only (a short epoch)")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend for the compiled contenders")
    p.add_argument("--out", type=Path, help="write static-shapes.md and static-shapes.csv here (docs/results)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ours = args.data
        if ours is None:
            ours = Path(tmp) / "ds"
            convert_dataset([str(args.sample / "encoded_nomlm.h5")], ours, str(args.sample / "vocab.csv"),
                            opts=ConvertOptions(progress=False))
        result = measure(ours, args.split, args.tokens_per_batch, args.steps, args.backend)
    for row in result["rows"]:
        print(row)
    if args.out:
        write_csv(args.out / "static-shapes.csv", result["rows"])
        (args.out / "static-shapes.md").write_text(report(result, args))


if __name__ == "__main__":
    main()
