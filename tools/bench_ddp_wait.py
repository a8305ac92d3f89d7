"""What token-balanced batches buy under DDP: each rank's compute and its wait in the gradient all-reduce, today's
persons plan against the token-budget plan, on real processes.

For each number of ranks and batch size, R processes join a gloo process group (one thread each: OMP_NUM_THREADS=1
and torch.set_num_threads(1)) and train the reference encoder (:class:`~lifeseq_shards.encoder.LifeSeqEncoder` at a
small width, :data:`SIZE`, in the packed layout) on the sample's persons, whose lengths the researchers' sample gives
(synthetic token ids of those lengths: the content does not matter to the time). Two plans over the same persons:
*persons* (today's reader: ``batch`` persons a rank a step, dealt as the reader deals them, ``workers`` DataLoader
workers a rank) and *tokens* (:func:`lifeseq_shards.plan.balance.plan_epoch` at the budget of ``batch`` persons'
mean tokens). Each plan's epochs are cut into ``rounds`` runs of consecutive steps, and the runs of the two plans
alternate (ABBA), so the machine's drift falls on both.

A step, on every rank: a barrier (the ranks start together, as they leave a DDP step's last all-reduce), forward +
backward (``compute``), the gradients flattened into one tensor, its all-reduce (``reduce``: the wait for the last
rank plus the all-reduce's own cost), then a barrier and the same all-reduce again (``own``: its cost when the ranks
arrive together). ``wait`` = reduce - own. As the ranks share one clock (perf_counter is CLOCK_MONOTONIC), the wait
is also read directly: the last rank's arrival at the all-reduce less this rank's (``wait_clock``). The node's step
runs from the first rank's start to the last rank's end of the all-reduce. Before the steps, each rank times
forward + backward of random batches of 0.2-2x ``batch`` persons (warm-up and the fit of compute time against
tokens). Writes OUT/balance-ddp.md, OUT/balance-ddp.csv (per mode), OUT/balance-ddp-steps.csv (per step and rank),
OUT/balance-ddp-fit.csv and OUT/balance-ddp.png.

    python -m tools.bench_ddp_wait --out docs/results --sample ../shared/data/lifeseq-sample
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pickle
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lifeseq_shards.plan.balance import plan_epoch
from lifeseq_shards.plan.compare import persons_left_out
from lifeseq_shards.plan.partition import EVEN, Partition
from lifeseq_shards.plan.resume import Arrangement
from lifeseq_shards.plan.slots import slot_index
from tools.common import sample_lengths, shards_of, write_csv

MODES = ("persons", "tokens")
# hidden 128, ff 512, one layer: at 64 wide the CPU's padded attention (padded-sdpa) is a larger part of the step, so
# the step follows tokens less (R^2 0.94 against 0.997 in a trial); one layer keeps a step of 50 persons near 0.2 s
SIZE = (128, 512, 1, 2)  # hidden, ff, layers, heads
VOCAB = 2971  # the sample's vocabulary (vocab.csv): the MLM decoder's width
TARGETS = 0.15  # MLM targets a person, as a share of the batch's longest
CALIBRATE = (0.2, 0.5, 1.0, 1.5, 2.0)  # calibration batches, in batches of `batch` persons
WORKERS = 2  # DataLoader workers a rank, as tools/bench_balance.py (the plans balance.md measured)


@dataclass(frozen=True)
class Job:
    """What every rank of one world runs: the lengths, the steps in order (mode, epoch, step, round) and each
    step's persons for each rank."""

    ranks: int
    batch: int
    lengths: np.ndarray
    steps: list[tuple[str, int, int, int]]
    persons: list[list[np.ndarray]]  # [step][rank]


def persons_plan_batches(lengths: np.ndarray, sizes: Sequence[int], ranks: int, workers: int, batch: int,
                         epoch: int) -> list[list[np.ndarray]]:
    """The persons plan's (step, rank) batches as person indices: the reader's balanced partition (its windows and
    shuffles), each rank's workers in the DataLoader's round robin (one batch a message), ``batch`` persons a batch.
    :func:`lifeseq_shards.plan.compare.persons_plan_costs` sums the same batches' costs (the test checks the two
    agree); it gives no person indices, which a run needs."""
    part = Partition(tuple(sizes[:-1]), ranks, workers, EVEN, 0, True, batch, False, 4096, int(sizes[-1]))
    first = np.concatenate([[0], np.cumsum(sizes)])  # the remainder is shard number len(sizes) - 1
    per_rank = []
    for rank in range(ranks):
        streams = []
        for worker in range(max(1, workers)):
            ids = [np.concatenate([np.arange(first[s.shard] + s.start, first[s.shard] + s.stop)
                                   for s in win.segments])[order]
                   for win, order in part.ordered_windows(slot_index(rank, worker, workers), epoch, 0)]
            mine = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
            streams.append([mine[i : i + batch] for i in range(0, len(mine), batch)])
        per_rank.append([s[j] for j in range(max(map(len, streams))) for s in streams if j < len(s)])
    if len({len(r) for r in per_rank}) != 1:
        raise RuntimeError("the persons plan gave the ranks different numbers of batches")
    return [list(step) for step in zip(*per_rank, strict=True)]


def tokens_plan_batches(lengths: np.ndarray, sizes: Sequence[int], ranks: int, workers: int, budget: int,
                        epoch: int) -> list[list[np.ndarray]]:
    plan = plan_epoch(lengths, sizes, Arrangement.of_budget(budget, ranks, workers), epoch=epoch)
    return [[plan.batch(s, r) for r in range(ranks)] for s in range(plan.steps)]


def make_job(lengths: np.ndarray, ranks: int, workers: int, batch: int, epochs: int, rounds: int) -> Job:
    """Both plans' epochs, their steps cut into ``rounds`` runs each, the runs alternating persons / tokens and
    tokens / persons (ABBA), epoch by epoch."""
    sizes = shards_of(len(lengths))
    budget = int(round(batch * lengths.mean()))
    steps, persons = [], []
    for epoch in range(epochs):
        plans = {"persons": persons_plan_batches(lengths, sizes, ranks, workers, batch, epoch),
                 "tokens": tokens_plan_batches(lengths, sizes, ranks, workers, budget, epoch)}
        cuts = {m: np.linspace(0, len(p), rounds + 1).round().astype(int) for m, p in plans.items()}
        for r in range(rounds):
            for mode in MODES if (r + epoch) % 2 == 0 else MODES[::-1]:
                for s in range(cuts[mode][r], cuts[mode][r + 1]):
                    steps.append((mode, epoch, s, r))
                    persons.append(plans[mode][s])
    return Job(ranks, batch, lengths, steps, persons)


# -- on each rank ------------------------------------------------------------------------------------------------
def synthetic_batch(lens: np.ndarray, gen: Any) -> Any:
    """A packed model batch of persons of these lengths: random token ids, times, segments and MLM targets."""
    import torch

    from lifeseq_shards.device.batch import PackedModelBatch

    n, b = int(lens.sum()), len(lens)
    ids = torch.randint(5, VOCAB, (4, n), generator=gen)  # 0-4 are the special tokens
    ids[1] *= 5  # abspos: days
    ids[2] %= 100  # age: years
    ids[3] = 1 + ids[3] % 2  # segment 1 or 2
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.as_tensor(np.cumsum(lens))
    t = max(1, int(TARGETS * lens.max()))
    rows = cu[:-1].long()[:, None] + (torch.rand(b, t, generator=gen) * torch.as_tensor(lens)[:, None]).long()
    return PackedModelBatch({"input_ids": ids, "cu_seqlens": cu, "max_len": int(lens.max()), "target_index": rows,
                             "target_tokens": torch.randint(5, VOCAB, (b, t), generator=gen),
                             "target_cls": torch.randint(0, 3, (b,), generator=gen)})


def _rank(rank: int, world: int, port: int, job_path: str, out: str, timeout_s: float) -> None:
    """One rank: calibration, then the job's steps; its times into ``out``/rank<r>.npz."""
    import torch
    import torch.distributed as dist

    from lifeseq_shards.encoder import EncoderConfig, LifeSeqEncoder
    from lifeseq_shards.model import pretrain_losses

    torch.set_num_threads(1)
    job: Job = pickle.loads(Path(job_path).read_bytes())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)  # every rank the same weights, as DDP's first broadcast makes them
    model = LifeSeqEncoder(EncoderConfig(*SIZE), VOCAB, dropout=0.0)  # no dropout: its masks are not tokens' work
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(rank)

    def compute(lens: np.ndarray) -> tuple[float, float, float, float]:
        batch = synthetic_batch(lens, gen)
        w, c = time.perf_counter(), time.thread_time()
        mlm, cls = pretrain_losses(model, batch)
        (mlm + cls).backward()
        return w, time.perf_counter(), c, time.thread_time()

    rng = np.random.default_rng(rank)
    calib = []
    dist.barrier()
    for rep in range(2):  # the first pass warms up and is not kept
        for f in CALIBRATE:
            lens = job.lengths[rng.choice(len(job.lengths), max(1, round(f * job.batch)), replace=False)]
            w0, w1, c0, c1 = compute(lens)
            for p in params:
                p.grad = None
            if rep:
                calib.append((len(lens), lens.sum(), len(lens) * lens.max(), w1 - w0, c1 - c0))
    times, cpu, trained = [], [], []
    dist.barrier()
    for persons in job.persons:
        ids = persons[rank]
        lens = job.lengths[ids]
        dist.barrier()
        t0, t1, c0, c1 = compute(lens)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        t2 = time.perf_counter()
        dist.all_reduce(flat)
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        dist.all_reduce(flat)
        t5 = time.perf_counter()
        for p in params:
            p.grad = None
        times.append((t0, t1, t2, t3, t4, t5))
        cpu.append(c1 - c0)
        trained.append(ids)
    np.savez(Path(out) / f"rank{rank}.npz", times=np.array(times), cpu=np.array(cpu), calib=np.array(calib, float),
             counts=np.array([len(i) for i in trained]), ids=np.concatenate(trained))
    dist.destroy_process_group()


# -- in the parent ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """``values`` in os.environ while the ranks start (spawned processes inherit it), the old values after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_world(job: Job, timeout_s: float) -> list[dict[str, np.ndarray]]:
    """The job on ``job.ranks`` spawned processes; each rank's arrays. TimeoutError (the ranks killed) past
    ``timeout_s``; a rank's exception raised here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.pkl"
        job_path.write_bytes(pickle.dumps(job))
        # one thread a rank, set before torch starts in the child (its OpenMP pool is sized at import)
        with _env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            ctx = mp.start_processes(_rank, args=(job.ranks, _free_port(), str(job_path), tmp, timeout_s),
                                     nprocs=job.ranks, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job.ranks} ranks ran past {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [dict(np.load(Path(tmp) / f"rank{r}.npz")) for r in range(job.ranks)]


def step_rows(job: Job, ranks: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
    """One row per (step, rank): the plan's step, the batch, and the times derived from the rank's clocks."""
    t = np.stack([r["times"] for r in ranks], axis=1)  # (steps, ranks, 6)
    cpu = np.stack([r["cpu"] for r in ranks], axis=1)
    step = t[:, :, 3].max(axis=1) - t[:, :, 0].min(axis=1)
    last = t[:, :, 2].max(axis=1)
    rows = []
    for i, (mode, epoch, s, rnd) in enumerate(job.steps):
        for r in range(job.ranks):
            lens = job.lengths[job.persons[i][r]]
            reduce, own = t[i, r, 3] - t[i, r, 2], t[i, r, 5] - t[i, r, 4]
            rows.append({"ranks": job.ranks, "batch": job.batch, "mode": mode, "epoch": epoch, "step": s,
                         "round": rnd, "rank": r, "persons": len(lens), "tokens": int(lens.sum()),
                         "padded": len(lens) * int(lens.max()), "compute_s": t[i, r, 1] - t[i, r, 0],
                         "cpu_s": cpu[i, r], "reduce_s": reduce, "own_s": own, "wait_s": reduce - own,
                         "wait_clock_s": last[i] - t[i, r, 2], "cpu_wait_s": cpu[i].max() - cpu[i, r],
                         "step_s": step[i]})
    return rows


def coverage(job: Job, ranks: list[dict[str, np.ndarray]]) -> dict[str, dict[str, int]]:
    """Per mode, from what the ranks report they trained: persons trained per epoch, of them distinct, and the
    persons the plan leaves out of an epoch."""
    ids = [np.split(r["ids"], np.cumsum(r["counts"])[:-1]) for r in ranks]
    out = {}
    for mode in MODES:
        trained, distinct = [], []
        for epoch in sorted({e for _, e, _, _ in job.steps}):
            mine = [ids[r][i] for i, (m, e, _, _) in enumerate(job.steps) if (m, e) == (mode, epoch)
                    for r in range(job.ranks)]
            every = np.concatenate(mine)
            trained.append(len(every))
            distinct.append(len(np.unique(every)))
        left = persons_left_out(shards_of(len(job.lengths)), job.ranks, WORKERS) if mode == "persons" else 0
        out[mode] = {"trained": min(trained), "distinct": min(distinct), "left_out": left}
    return out


def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b), float(1 - ((a + b * x - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def r2_with_padding(tokens: np.ndarray, padded: np.ndarray, y: np.ndarray) -> float:
    """R^2 of y = a + b tokens + c padded slots (persons x longest: what the CPU's padded attention pays for)."""
    x = np.c_[np.ones(len(y)), tokens, padded]
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(1 - ((x @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def fit_rows(job: Job, ranks: list[dict[str, np.ndarray]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Forward + backward time against tokens, in wall and in the rank's CPU seconds (what other jobs on the machine
    do not lengthen): over the calibration batches (0.2-2x the batch) and over the measured steps."""
    calib = np.concatenate([r["calib"] for r in ranks])
    steps = {k: np.array([r[k] for r in rows], float) for k in ("tokens", "padded", "compute_s", "cpu_s")}
    out = []
    for name, tokens, padded, times in (
            ("calibration", calib[:, 1], calib[:, 2], {"wall": calib[:, 3], "cpu": calib[:, 4]}),
            ("steps", steps["tokens"], steps["padded"], {"wall": steps["compute_s"], "cpu": steps["cpu_s"]})):
        for clock, y in times.items():
            a, b, r2 = fit(tokens, y)
            out.append({"ranks": job.ranks, "batch": job.batch, "points": name, "clock": clock, "n": len(y),
                        "tokens_min": int(tokens.min()), "tokens_max": int(tokens.max()),
                        "intercept_s": round(a, 4), "us_per_token": round(b * 1e6, 2), "r2": round(r2, 3),
                        "r2_with_padded": round(r2_with_padding(tokens, padded, y), 3)})
    return out


def summarise(job: Job, rows: list[dict[str, Any]], cover: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """One row per mode: means over its steps (and ranks), the node's waiting share, and the new/old ratios in the
    tokens row."""
    out = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        col = {k: np.array([r[k] for r in mine], float) for k in mine[0] if isinstance(mine[0][k], (int, float))}
        tok = col["tokens"].reshape(-1, job.ranks)
        cpu_step = col["cpu_s"].reshape(-1, job.ranks).max(axis=1) + col["own_s"].reshape(-1, job.ranks).mean(axis=1)
        steps = len(tok)
        epochs = len({r["epoch"] for r in mine})
        out.append({
            "ranks": job.ranks, "batch": job.batch, "mode": mode, "steps_per_epoch": steps // epochs,
            "step_s": col["step_s"][:: job.ranks].mean(), "compute_s": col["compute_s"].mean(),
            "wait_s": col["wait_s"].mean(), "wait_clock_s": col["wait_clock_s"].mean(), "own_s": col["own_s"].mean(),
            "wait_share": col["wait_s"].sum() / (job.ranks * col["step_s"][:: job.ranks].sum()),
            "cpu_wait_share": col["cpu_wait_s"].sum() / (job.ranks * cpu_step.sum()),
            "epoch_s": col["step_s"][:: job.ranks].sum() / epochs,
            "tokens_max_min": float((tok.max(axis=1) / tok.min(axis=1)).mean()),
            "tokens_rank_mean": float(tok.mean()), **{f"persons_{k}": v for k, v in cover[mode].items()},
        })
    old, new = out
    for k in ("step_s", "compute_s", "wait_s", "wait_share", "epoch_s"):
        new[f"{k}_ratio"] = new[k] / old[k] if old[k] else float("nan")
    return out


def plot(summary: list[dict[str, Any]], fits: list[dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{s['ranks']}r {s['batch']}p\n{s['mode']}" for s in summary]
    compute = np.array([s["compute_s"] for s in summary])
    wait = np.array([s["wait_s"] for s in summary])
    own = np.array([s["own_s"] for s in summary])
    x = np.arange(len(summary))
    ax.bar(x, compute, label="compute (mean rank)")
    ax.bar(x, wait, bottom=compute, label="wait in the all-reduce")
    ax.bar(x, own, bottom=compute + wait, label="all-reduce, ranks together")
    ax.plot(x, [s["step_s"] for s in summary], "k_", markersize=20, label="node's step")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("seconds a step")
    ax.legend(fontsize=7)
    first = (summary[0]["ranks"], summary[0]["batch"])
    pts = [r for r in rows if (r["ranks"], r["batch"]) == first]
    # CPU seconds: the wall clock of a shared machine mostly shows the other jobs
    for mode, marker in zip(MODES, "ox", strict=True):
        bx.scatter([r["tokens"] for r in pts if r["mode"] == mode], [r["cpu_s"] for r in pts if r["mode"] == mode],
                   s=6, marker=marker, label=f"{mode} plan steps")
    for points, style in (("calibration", "k--"), ("steps", "k-")):
        f = next(f for f in fits if (f["ranks"], f["batch"], f["points"], f["clock"]) == (*first, points, "cpu"))
        xs = np.array([f["tokens_min"], f["tokens_max"]])
        bx.plot(xs, f["intercept_s"] + f["us_per_token"] * 1e-6 * xs, style,
                label=f"fit to the {points}, R^2 {f['r2']}")
    bx.set_xlabel("real tokens of the rank's batch")
    bx.set_ylabel("forward + backward, CPU s")
    bx.set_title(f"{first[0]} ranks, {first[1]} persons", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary: list[dict[str, Any]], fits: list[dict[str, Any]], argv: str, meta: dict[str, Any]) -> str:
    def num(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    def table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
        return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                *["| " + " | ".join(num(r.get(c, "")) for c in cols) + " |" for r in rows]]

    cols = ["ranks", "batch", "mode", "steps_per_epoch", "step_s", "compute_s", "wait_s", "wait_clock_s", "own_s",
            "wait_share", "cpu_wait_share", "epoch_s", "tokens_max_min", "step_s_ratio", "compute_s_ratio",
            "wait_s_ratio", "wait_share_ratio", "epoch_s_ratio"]
    fit_cols = ["ranks", "batch", "points", "clock", "n", "tokens_min", "tokens_max", "intercept_s", "us_per_token",
                "r2", "r2_with_padded"]
    over = [r for r in sorted({s["ranks"] for s in summary}) if r > meta["cores"]]
    return "\n".join([
        "# Balance under DDP: the ranks' wait in the gradient all-reduce, persons plan against token-budget plan",
        "",
        f"Made by `python -m tools.bench_ddp_wait {argv}`, {meta['date']} UTC, on {meta['machine']} "
        f"({meta['cores']} CPU cores shared with other engineers' jobs; load average {meta['load']} at the start), "
        f"torch {meta['torch']}, gloo. CPU only: **a GPU run waits** (no GPU was lent to this measurement).",
        "",
        "## Method",
        "",
        f"The sample's {meta['persons']:,} persons (encoded_nomlm.h5, real tokens = its padding mask's sum; shards of "
        "1,024 and a remainder, as in [balance.md](balance.md)), synthetic token ids of those lengths. R ranks "
        "are R spawned processes in one gloo process group, one thread each (OMP_NUM_THREADS=1, "
        f"torch.set_num_threads(1)), each training the reference encoder (hidden {SIZE[0]}, ff {SIZE[1]}, "
        f"{SIZE[2]} layer, {SIZE[3]} heads, vocabulary {VOCAB}, no dropout) in the packed, padding-free layout "
        "(on a CPU its attention pads each person to the batch's longest around SDPA; the other layers see only "
        f"real tokens), MLM on {TARGETS:.0%} of the batch's longest a person, and CLS. *persons*: today's reader, "
        f"`batch` persons a rank a step, dealt as the reader deals them ({WORKERS} DataLoader workers a rank, "
        "balanced mode: its windows and shuffles, the workers' round robin); *tokens*: `plan_epoch` at a budget "
        "of `batch` x the mean length. Both plans' epochs, each cut into runs of consecutive steps that alternate "
        "persons/tokens, then tokens/persons (ABBA), in one run, so the machine's drift falls on both.",
        "",
        "Each step, on every rank: a barrier (the ranks start together, as after the last step's all-reduce); "
        "forward + backward (`compute_s`, wall; the same in the rank's CPU time feeds `cpu_wait_share`); the "
        "gradients flattened into one tensor; its all-reduce, timed (the wait for the last rank plus the "
        "all-reduce's own cost); a barrier and the same all-reduce again (`own_s`: its cost when the ranks arrive "
        "together). `wait_s` = the first all-reduce less `own_s`; `wait_clock_s` the same read from the shared "
        "clock (the last rank's arrival less this rank's), a check on it. `step_s`: the node's step, from the "
        "first rank's start to the last rank's end of the all-reduce. `wait_share`: the node's waiting share of "
        "the step, sum of the ranks' waits / (ranks x step). `cpu_wait_share`: the same from each rank's CPU "
        "seconds of forward + backward (wait = the step's most less the rank's; step = the most + `own_s`), what "
        "the waits would be with a core to each rank and no other jobs. `epoch_s`: the steps of one epoch added "
        "up (the token-budget plan has a few % more steps). `tokens_max_min`: max / min tokens across the "
        "ranks of a step, mean over the steps. Means over steps and ranks; the `*_ratio` columns are tokens / "
        "persons. Not timed: building each batch (the loader's work) and an optimizer step (the same in both "
        "plans; gradients are dropped after each step). A real DDP step overlaps the all-reduce with the "
        "backward in buckets; the last bucket's wait is the one measured here.",
        "",
        *([f"**{', '.join(map(str, over))} ranks oversubscribe the {meta['cores']} cores**: two ranks share a core, "
           "so a rank's wall compute includes the time its neighbour ran, and a rank that waits in the all-reduce "
           "gives its core to a neighbour still computing; those rows' wall waits do not say what a node with a "
           "core (or GPU) a rank would wait. They are reported, flagged; `cpu_wait_share` is the estimate that "
           "does not depend on the sharing."] if over else []),
        "",
        "## Results",
        "",
        *table(summary, cols),
        "",
        "## Compute time against tokens",
        "",
        "Least-squares fit of each rank's forward + backward against its batch's real tokens, in wall seconds and "
        "in the rank's CPU seconds (which other jobs on the machine do not lengthen): over the calibration batches "
        "(random persons, 0.2-2x `batch`, timed on every rank before the steps) and over the measured steps; "
        "`r2_with_padded` adds persons x the longest (what the CPU's padded attention pays for) as a second term.",
        "",
        *table(fits, fit_cols),
        "",
        "![Left: the mean step split into compute, wait and the all-reduce's own cost, per plan. Right: compute "
        "(CPU seconds) against tokens of the first arrangement's steps, and the fits.](balance-ddp.png)",
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sample", type=Path, required=True, help="The researchers' sample folder (encoded_nomlm.h5).")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[50], help="Persons a rank a step of the persons plan.")
    p.add_argument("--epochs", type=int, default=2, help="Epochs of each plan.")
    p.add_argument("--rounds", type=int, default=10, help="Runs of consecutive steps each plan's epoch is cut into.")
    p.add_argument("--limit", type=int, default=0, help="Only the sample's first N persons (0: all).")
    p.add_argument("--timeout", type=float, default=900.0, help="Seconds each world may run.")
    a = p.parse_args(argv)
    import torch

    lengths = sample_lengths(a.sample)
    lengths = lengths[: a.limit] if a.limit else lengths
    meta = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": platform.processor() or
            platform.machine(), "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "torch": torch.__version__, "persons": len(lengths)}
    rows, summary, fits = [], [], []
    for batch in a.batch:
        for ranks in a.ranks:
            job = make_job(lengths, ranks, WORKERS, batch, a.epochs, a.rounds)
            started = time.perf_counter()
            result = run_world(job, a.timeout)
            mine = step_rows(job, result)
            rows += mine
            summary += summarise(job, mine, coverage(job, result))
            fits += fit_rows(job, result, mine)
            print(json.dumps({"ranks": ranks, "batch": batch, "wall_s": round(time.perf_counter() - started, 1),
                              **{s["mode"]: round(s["step_s"], 4) for s in summary[-2:]}}), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "balance-ddp.csv", [{k: round(v, 5) if isinstance(v, float) else v for k, v in s.items()}
                                          for s in summary])
    write_csv(a.out / "balance-ddp-fit.csv", fits)
    write_csv(a.out / "balance-ddp-steps.csv", [{k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()}
                                                for r in rows])
    plot(summary, fits, rows, a.out / "balance-ddp.png")
    args = " ".join(argv if argv is not None else sys.argv[1:])
    (a.out / "balance-ddp.md").write_text(markdown(summary, fits, args, meta))


if __name__ == "__main__":
    main()
