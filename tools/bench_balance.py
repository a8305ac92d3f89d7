"""The balance of the ranks of a step, today's persons plan against the token-budget plan, on the same lengths, in the
shards the converter makes for each arrangement.

For each population (the train split `shardify convert` makes of the sample's sequences.parquet, `shardify synth`
populations), arrangement (2, 4, 8 ranks, 0 or 2 DataLoader workers a rank, in the shards `shardify convert --nodes 1
--gpus R --workers W` cuts for it) and budget (the tokens that 50 and 256 persons hold on average), the plans of
epochs 0..E-1 are made from the persons' lengths alone: the persons plan
(:func:`lifeseq_shards.plan.compare.persons_plan_costs`, a fixed number of persons a rank, dealt as the reader deals
them) and the token-budget plan (:func:`lifeseq_shards.plan.balance.plan_epoch`), balancing tokens (the default) and
len^2. Of each step: max / mean across its ranks of the real tokens and of len^2. With the sample, each arrangement's
conversion is made and read by every rank's real reader (epoch 0, the smaller budget): the tokens each rank
received must be the plan's, else the bench stops. Then the time and peak memory of planning one epoch of
``--plan-persons`` synthetic lengths, and one worker's slot of it, each in a process of its own. Writes
OUT/balance.md (method, commit and tables), OUT/balance.csv and OUT/balance.png.

    python -m tools.bench_balance --out docs/results --sample tests/data/lifeseq-sample --synth 100000 1000000
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset, shard_count
from lifeseq_shards.convert.sources.drops import MIN_EVENTS
from lifeseq_shards.convert.sources.parquet import DEFAULT_TIME_RANGE, PREFIX_LEN
from lifeseq_shards.convert.sources.synth import (
    ABSPOS_END,
    BIRTH_YEARS,
    EVENT_KINDS,
    EVENTS_MAX,
    EVENTS_MEDIAN,
    EVENTS_SIGMA,
    GENDER_WEIGHTS,
    KIND_WEIGHTS,
)
from lifeseq_shards.plan.balance import ATTENTION, LOOKAHEAD, PICKS, TOKENS, balance_ratios, plan_epoch
from lifeseq_shards.plan.compare import persons_plan_costs
from lifeseq_shards.plan.order import default_window
from lifeseq_shards.plan.resume import Arrangement
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from lifeseq_shards.reader.loader import RING_MESSAGE_PERSONS
from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.remote import read_manifest
from tools.common import commit, write_csv

RANKS, PERSONS, WORKERS = (2, 4, 8), (50, 256), (0, 2)
PLANS = {"tokens": TOKENS, "attention": ATTENTION}  # the token-budget plan's rows, by its balance=
GROUP = 50_000  # synth's rows a row group: its RNG stream per group


def synth_lengths(people: int, seed: int = 0, max_seq_len: int = 512) -> np.ndarray:
    """Lengths shaped as `shardify synth` + convert make them, without writing them: each row group's births and
    events per person drawn from synth's own RNG stream (the draws before them replayed); from another stream, how
    many of a person's events fall inside the default time range (its days are uniform from birth to ABSPOS_END)
    and their kinds (tokens by synth's weights); the most recent events that fit under ``max_seq_len`` with a [SEP]
    each, after the prefix; persons with fewer than MIN_EVENTS events in range dropped."""
    fields = np.array([len(f) for _, f in EVENT_KINDS])
    out = []
    for g, first in enumerate(range(0, people, GROUP)):
        n = min(GROUP, people - first)
        rng = np.random.default_rng([seed, g])
        year, month = rng.integers(BIRTH_YEARS.start, BIRTH_YEARS.stop, n), rng.integers(1, 13, n)
        birth = np.floor((year - 1972) * 365.25 + (month - 1) * 30.44 + rng.integers(0, 29, n) + 1)
        rng.choice(len(GENDER_WEIGHTS), n, p=GENDER_WEIGHTS), rng.random(n), rng.random(n)
        drawn = np.minimum(np.rint(rng.lognormal(np.log(EVENTS_MEDIAN), EVENTS_SIGMA, n)), EVENTS_MAX).astype(np.int64)
        start = np.clip(birth, 0, ABSPOS_END - 1)
        own = np.random.default_rng([seed, g, 1])
        events = own.binomial(drawn, np.clip((DEFAULT_TIME_RANGE[1] + 1 - start) / (ABSPOS_END + 1 - start), 0, 1))
        kinds = own.choice(len(fields), int(events.sum()), p=KIND_WEIGHTS)
        ev_len = fields[kinds] + 1
        cum = np.cumsum(ev_len)
        end = np.repeat(cum[np.cumsum(events) - 1], events)
        fits = PREFIX_LEN + end - cum + ev_len < max_seq_len  # the person's latest events, as the converter keeps
        owner = np.repeat(np.arange(n), events)
        length = PREFIX_LEN + np.bincount(owner, weights=ev_len * fits, minlength=n).astype(np.int64)
        out.append(length[events >= MIN_EVENTS])
    return np.concatenate(out)


def arrangement_options(ranks: int, workers: int) -> ConvertOptions:
    """`shardify convert --nodes 1 --gpus R --workers W`'s options (0 workers: the rank's process reads, one reader a
    rank, as --workers 1 converts for)."""
    return ConvertOptions(nodes=1, gpus=ranks, workers=workers or None, progress=False)


def arrangement_shards(persons: int, ranks: int, workers: int) -> list[int]:
    """The shard sizes of a train split of ``persons`` that `shardify convert` cuts for the arrangement: equal shards, a
    multiple of its readers, the rest a remainder shard (last, absent when empty)."""
    s = shard_count(persons, arrangement_options(ranks, workers), "train")
    return [persons // s] * s + ([persons % s] if persons % s else [])


def convert_sample(sample: Path, out: Path, opts: ConvertOptions) -> Path:
    """The sample's sequences.parquet converted into ``out`` with ``opts``, as `shardify convert` does."""
    convert_dataset([str(sample / "sequences.parquet")], out, str(sample / "vocab.csv"),
                    opts=replace(opts, overwrite=True, progress=False))
    return out


def train_lengths(root: Path) -> tuple[np.ndarray, list[int]]:
    """(real tokens of each train person in the split's order, its shards' sizes) of a converted dataset."""
    return split_lengths(str(root), read_manifest(root), "train")


def per_message(lengths: np.ndarray, budget: int, workers: int) -> int:
    """Batches a worker sends in one message, as ShardedLoader picks them for packed batches (what both front ends
    read): about RING_MESSAGE_PERSONS persons. They set which worker's batch is the rank's next step."""
    return max(1, RING_MESSAGE_PERSONS // max(1, round(budget * len(lengths) / int(lengths.sum())))) if workers else 1


def reader_tokens(root: Path, ranks: int, workers: int, budget: int, epoch: int) -> np.ndarray:
    """Real tokens of each (step, rank) batch of epoch ``epoch``, as each rank's own reader gives them (``World(r,
    R)``, ``workers`` DataLoader workers, ``tokens_per_batch=budget``, packed batches as the front ends read),
    shape (steps, ranks)."""
    per_rank = []
    for rank in range(ranks):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an arrangement's start-up notes: not what is measured
            ds = ShardedDataset(root, split="train", world=World(rank, ranks), num_workers=workers, packed=True,
                                tokens_per_batch=budget)
        loader = ShardedLoader(ds)
        loader.set_epoch(epoch)
        per_rank.append([b.counts[b.names.index("tokens")] for b in loader])
    return np.array(per_rank).T


def check_reader(sample: Path, work: Path, epoch: int = 0) -> int:
    """Each arrangement's conversion of the sample, read by each of its ranks' readers at the smaller budget: its shards
    must be :func:`arrangement_shards`' and the tokens each rank received the plan's (RuntimeError otherwise). Returns
    the steps compared."""
    steps = 0
    for ranks, workers in itertools.product(RANKS, WORKERS):
        root = convert_sample(sample, work / f"sample-{ranks}x{workers}", arrangement_options(ranks, workers))
        lengths, sizes = train_lengths(root)
        if sizes != arrangement_shards(len(lengths), ranks, workers):
            raise RuntimeError(f"{root}: shards {sizes}, not the {arrangement_shards(len(lengths), ranks, workers)} "
                               "the bench plans on")
        budget = int(round(PERSONS[0] * lengths.mean()))
        got = reader_tokens(root, ranks, workers, budget, epoch)
        lay = Arrangement.of_budget(budget, ranks, workers, window=default_window(sizes),
                                    batches_per_message=per_message(lengths, budget, workers))
        want = plan_epoch(lengths, sizes, lay, epoch=epoch).step_costs(lengths)
        if not np.array_equal(got, want):
            raise RuntimeError(f"{root}: at {ranks} ranks x {workers} workers the readers gave other tokens than the "
                               "plan")
        steps += len(got)
    return steps


def compare(name: str, lengths: np.ndarray, epochs: int) -> tuple[list[dict[str, object]], dict[str, np.ndarray]]:
    """Rows of the table for one population, and the per-step token ratios of each (plan, ranks, persons) at the last
    of :data:`WORKERS` (the plot's)."""
    rows, ratios = [], {}
    for ranks, persons, workers in itertools.product(RANKS, PERSONS, WORKERS):
        sizes = arrangement_shards(len(lengths), ranks, workers)
        window = default_window(sizes)  # the reader's: a remainder is smaller than a shard
        budget = int(round(persons * lengths.mean()))
        costs = {"persons": [[persons_plan_costs(lengths, sizes, ranks, workers, persons, epoch=e, window=window,
                                                 cost=c) for e in range(epochs)] for c in (TOKENS, ATTENTION)]}
        for plan, cost in PLANS.items():
            lay = Arrangement.of_budget(budget, ranks, workers, window=window,
                                        batches_per_message=per_message(lengths, budget, workers))
            new = [plan_epoch(lengths, sizes, lay, epoch=e, cost=cost) for e in range(epochs)]
            costs[plan] = [[p.step_costs(lengths, c) for p in new] for c in (TOKENS, ATTENTION)]
        for plan, (tokens, attention) in costs.items():
            t = np.concatenate([balance_ratios(c) for c in tokens])
            a = np.concatenate([balance_ratios(c) for c in attention])
            work = np.concatenate(tokens)
            if workers == WORKERS[-1] and plan != "attention":
                ratios[f"{name} {plan} {ranks}r {persons}p"] = t
            rows.append({"population": name, "persons": len(lengths), "ranks": ranks, "workers": workers,
                         "batch_persons": persons, "budget": budget, "plan": plan, "steps": len(tokens[0]),
                         "tokens_mean": round(float(t.mean()), 4), "tokens_p99": round(float(np.quantile(t, 0.99)), 4),
                         "len2_mean": round(float(a.mean()), 4), "len2_p99": round(float(np.quantile(a, 0.99)), 4),
                         "max_rank_tokens": int(work.max()), "fill": round(float(work.mean() / budget), 3)})
    return rows, ratios


def plan_timing(persons: int, slot: bool = False) -> dict[str, float]:
    """Time (wall and CPU) and peak memory of planning one epoch of ``persons`` lengths (lognormal, median 332,
    capped at 511), 8 ranks x 4 workers at 16,384 tokens, in a fresh process: the whole epoch (``plan_epoch``), or
    with ``slot`` one worker's own slot of it (``plan_slot``, what a DataLoader worker plans for an ordinary epoch)."""
    plan = ("b = plan_slot(L, sizes, lay, 0, seed=1, epoch=3); steps = 4 * len(b)" if slot else
            "steps = plan_epoch(L, sizes, lay, seed=1, epoch=3).steps")
    code = (
        "import json, resource, time, tracemalloc, numpy as np\n"
        "from lifeseq_shards.plan.balance import plan_epoch, plan_slot\n"
        "from lifeseq_shards.plan.resume import Arrangement\n"
        "lay = Arrangement.of_budget(16384, 8, 4)\n"
        f"n = {persons}\n"
        "L = np.clip(np.random.default_rng(0).lognormal(np.log(332), 0.6, n), 6, 511).astype(np.uint16)\n"
        "sizes = [4096] * (n // 4096) + [n % 4096]\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "tracemalloc.start()\n"  # numpy's arrays are traced: the planning's own peak, whatever came before
        "w, c = time.perf_counter(), time.process_time()\n"
        f"{plan}\n"
        "out = dict(wall_s=time.perf_counter() - w, cpu_s=time.process_time() - c, steps=steps,\n"
        "           traced_mib=tracemalloc.get_traced_memory()[1] / 2**20,\n"
        "           lengths_mib=L.nbytes / 2**20,\n"
        "           peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, base_mib=base / 1024)\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=Path(__file__).resolve().parents[1])
    return {"persons": persons, **json.loads(r.stdout)}


def plot(ratios: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k.split(" ")[0] for k in ratios})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for key, values in ratios.items():
            pop, plan, ranks, persons = key.split(" ")
            if pop == name and persons == f"{PERSONS[0]}p":
                # the busiest rank's excess over the mean, in %, on a log axis: the two plans are 100x apart
                x = np.sort(np.maximum((values - 1) * 100, 1e-3))
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{plan}, {ranks}",
                        linestyle="-" if plan == "tokens" else "--", color=f"C{RANKS.index(int(ranks[:-1]))}")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
        ax.set_title(f"{name}: batch ~{PERSONS[0]} persons")
        ax.set_xlabel("busiest rank's real tokens over the step's mean, + %")
        ax.set_ylabel("share of steps (cumulative)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def headline(rows: Sequence[dict[str, object]], epochs: int) -> list[str]:
    """The token plan at 8 ranks x 50 persons, against the bar p99 <= 1.01, and why a population misses it."""
    tokens = [r for r in rows if r["plan"] == "tokens" and r["ranks"] == RANKS[-1]]
    at = [r for r in tokens if r["batch_persons"] == PERSONS[0]]
    if not at:
        return []
    lines = ["", f"## The token plan at {RANKS[-1]} ranks x {PERSONS[0]} persons: the bar p99 <= 1.01", ""]
    lines += [f"- {r['population']}, {r['workers']} workers: mean {r['tokens_mean']}, p99 {r['tokens_p99']} over "
              f"{r['steps']} steps an epoch" for r in at]
    over = [r for r in at if float(r["tokens_p99"]) > 1.01]  # type: ignore[arg-type]
    if not over:
        return [*lines, "", "Met by every population and worker count here."]
    # the p99 step's busiest rank over the mean rank, in tokens, against a mean person (budget / batch persons)
    excess = [(float(r["tokens_p99"]) - 1) * float(r["fill"]) * int(r["budget"]) for r in over]  # type: ignore
    share = [e / (int(r["budget"]) / PERSONS[0]) for e, r in zip(excess, over, strict=True)]  # type: ignore
    steps = [epochs * int(r["steps"]) for r in over]  # type: ignore[call-overload]
    big = [float(r["tokens_p99"]) for r in tokens if r["batch_persons"] == PERSONS[-1]]  # type: ignore[arg-type]
    return [*lines, "", f"Missed by {', '.join(sorted({str(r['population']) for r in over}))}: there the busiest "
            f"rank of the 99th-percentile step holds {min(excess):.0f}-{max(excess):.0f} tokens more than the step's "
            f"mean rank, {min(share):.2f}-{max(share):.2f} of a mean person. A batch ends at a person's end, and the "
            f"gap to its share is filled by at most {PICKS} persons among the next {LOOKAHEAD}: what they cannot "
            f"fill is up to a short person's tokens, about 1 % of a batch of ~{PERSONS[0]} persons (at "
            f"{PERSONS[-1]} persons a batch the same shortfall gives p99 <= {max(big, default=float('nan'))} here). "
            f"Of {min(steps)}-{max(steps)} steps pooled, the 99th percentile lies between the two largest. The plan "
            "is not changed to close the gap: a saved loader state resumes by planning its epoch again, so another "
            "plan would read other persons after a resume from a checkpoint saved before (tests/plan/test_balance.py "
            "pins the plan's bytes for that reason)."]


def markdown(rows: Sequence[dict[str, object]], timing: dict[str, float] | None, slot: dict[str, float] | None,
             epochs: int, run: dict[str, str]) -> str:
    cols = ["population", "persons", "ranks", "workers", "batch_persons", "budget", "plan", "steps", "tokens_mean",
            "tokens_p99", "len2_mean", "len2_p99", "max_rank_tokens", "fill"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    lines = [
        "# Balance of the ranks of a step: persons plan against token-budget plan",
        "",
        f"Measured at commit {run['commit']} by `python -m tools.bench_balance {run['argv']}`, {run['when']} UTC, "
        f"on a machine of {os.cpu_count()} CPU cores shared with other jobs (load average {run['load']}; the "
        "balance is a property of the plans: it does not depend on the machine; the planning time does).",
        "",
        "## Method",
        "",
        f"The plans are made from the persons' lengths alone, {' or '.join(map(str, WORKERS))} DataLoader workers a "
        "rank, in the shards `shardify convert --nodes 1 --gpus R --workers W` cuts for the arrangement (a multiple of "
        "its R x W readers, 0 workers converting as 1; tools/bench_balance.py `arrangement_shards`), the reader's "
        "default shuffle window (the larger of 4,096 persons and two shards), seed 0, epochs "
        f"0..{epochs - 1} pooled. "
        "*persons*: batches of persons, a fixed number of persons a rank a step, dealt as the reader deals them "
        "(balanced mode, its windows and shuffles, each rank's workers in the DataLoader's round robin). *tokens*: the "
        "token-budget plan (lifeseq_shards/plan/balance.py, `balance=\"tokens\"`, the default) at a budget of the "
        "tokens that many persons hold on average (`budget` = persons x mean length); *attention*: the same budget "
        "with `balance=\"attention\"` (each step's persons dealt to the ranks by length, evening out len^2). "
        "Per step: max / mean across its ranks of the real tokens "
        "(`tokens_*`) and of len^2 (`len2_*`, attention's cost), mean and 99th percentile over the steps; "
        "`max_rank_tokens` the most tokens any rank's batch held, `fill` the mean batch's tokens over the budget. "
        "The sample: the train split `shardify convert` makes of its sequences.parquet (the default val fraction; "
        "real tokens from the split's lengths index). synth-N: the lengths `shardify synth --people N` then "
        "`shardify convert` make (tools/bench_balance.py `synth_lengths`: synth's own births and events-per-person "
        "draws, the events in the default time range, its event kinds' weights), all of them as the train split.",
        "",
        f"What each rank receives: {run['checked']}",
        "",
        "## Results",
        "",
        *table,
        "",
        f"![per-step max/mean - 1 in %, cumulative, at ~50 persons a rank, {WORKERS[-1]} workers: persons plan dashed, "
        "token-budget plan solid](balance.png)",
        *headline(rows, epochs),
    ]
    if timing:
        lines += ["", "## Planning time and memory", "",
                  f"One epoch of {timing['persons']:,} lognormal lengths (median 332, capped at 511), 8 ranks x 4 "
                  f"workers, 16,384 tokens: {timing['steps']:,} steps, {timing['cpu_s']:.1f} s CPU "
                  f"({timing['wall_s']:.1f} s wall, on a machine whose 2 cores other jobs shared), peak RSS "
                  f"{timing['peak_mib']:.0f} MiB against {timing['base_mib']:.0f} MiB before planning (the "
                  f"interpreter, and making the lengths: {timing['lengths_mib']:.0f} MiB as uint16); the planning's "
                  f"own allocations peaked at {timing['traced_mib']:.0f} MiB (tracemalloc: more than the RSS "
                  "grew, as it reused the pages the lengths' float draw had freed)."]
    if timing and slot:
        lines += ["", f"What a DataLoader worker plans for an ordinary epoch, its own slot of the same epoch "
                  f"(`plan_slot`, the same batches as the whole plan's, tests/plan/test_slot_plan.py): "
                  f"{slot['cpu_s']:.2f} s CPU ({slot['wall_s']:.2f} s wall), its allocations peaking at "
                  f"{slot['traced_mib']:.0f} MiB (tracemalloc). The whole epoch is planned only for the rest "
                  "of an epoch resumed in another arrangement or budget, by `shardify plan`, and with "
                  "`balance=\"attention\"`."]
    lines += ["", "What the balance buys under DDP, in the ranks' wait at the gradient all-reduce on real processes: "
              "[balance-ddp.md](balance-ddp.md) (tools/bench_ddp_wait.py)."]
    return "\n".join(lines) + "\n"


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sample", type=Path, help="The researchers' sample folder (its sequences.parquet, vocab.csv).")
    p.add_argument("--synth", type=int, nargs="*", default=[], help="Synthetic populations of these many persons.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--plan-persons", type=int, default=0, help="Time one epoch's plan of this many persons.")
    a = p.parse_args(argv)
    run = {"commit": commit(), "argv": " ".join(argv if argv is not None else sys.argv[1:]),
           "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load": load(),
           "checked": "no sample, no reader check."}
    pops = []
    if a.sample:
        with tempfile.TemporaryDirectory() as work:
            steps = check_reader(a.sample, Path(work))
            pops.append(("sample", train_lengths(convert_sample(a.sample, Path(work) / "sample", ConvertOptions()))[0]))
        run["checked"] = (f"the sample converted for each arrangement and read by each of its ranks' own reader "
                          f"(`ShardedDataset(..., world=World(r, R), num_workers=W, tokens_per_batch=budget)`, epoch "
                          f"0, {PERSONS[0]} persons' budget): over its {steps} steps every rank received exactly "
                          "the tokens of the plan's batch (the bench stops otherwise), so the rows are what the "
                          "ranks receive.")
    pops += [(f"synth-{n // 1000}k" if n < 10**6 else f"synth-{n // 10**6}M", synth_lengths(n)) for n in a.synth]
    rows, ratios = [], {}
    for name, lengths in pops:
        r, q = compare(name, lengths, a.epochs)
        rows += r
        ratios |= q
        for row in r:
            print(json.dumps(row), flush=True)
    timing = plan_timing(a.plan_persons) if a.plan_persons else None
    slot = plan_timing(a.plan_persons, slot=True) if a.plan_persons else None
    run["load"] += f" at the start, {load()} at the end"
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "balance.csv", rows)
    plot(ratios, a.out / "balance.png")
    (a.out / "balance.md").write_text(markdown(rows, timing, slot, a.epochs, run))


if __name__ == "__main__":
    main()
