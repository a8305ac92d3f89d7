"""The researchers' performer encoder, padded to 512 as their loader gives it, against lifeseq_shards.performer's
packed forward of the same persons in token-budget batches: their training step (forward, backward, AdamW) and their
embedding (predict) pass, persons/s and tokens/s, in one run, the two taking turns round by round.

    python -m tools.bench_performer [--sizes small,medium] [--persons 64] [--batch 8] [--rounds 3]
                                    [--device cpu] [--precision fp32] [--profile] [--out docs/results/performer.md]

The model is their ``Transformer``'s structure built on their dependencies (tools/their_encoder.py: performer-pytorch
1.1.4's ``SelfAttention`` with local-attention 1.9.14's window, their edits; tests/test_performer.py checks it, and
``PackedPerformer``, against their own modules at 884ef02) at their small and medium dims. The padded side reads
``--batch`` persons a step, each padded to 512; the packed side (``PackedPerformer(model, pad_to=512, static=False)``,
their padded model's numbers, in the buckets its persons fill) the same persons in order, cut into batches of at most
``--batch`` x 512 real tokens. Both
decode the same MLM rows (every 7th token of each person) and the CLS of each person's first token; before timing,
the two forwards are checked to agree. Two populations: the sample's lengths (tests/data/lifeseq-sample, their
pipeline's output) and a long-tailed synthetic one (lognormal, capped at 512). The ratio is the median over rounds
of packed persons/s over padded persons/s; the bar is 0.8 x 1 / (1 - padding fraction), the padding fraction that
of the padded batches. Beside it, the cost per token: packed seconds per real token over padded seconds per padded
slot (1.0: packed reaches 1 / (1 - padding); the bar is <= 1.25). ``--device cuda`` with ``--precision`` fp32, tf32
(their ``set_float32_matmul_precision("medium")``) or bf16-mixed (autocast) is tools/device_check.sh's ``their``
stage; ``--profile`` prints the top operators of one training step of each side first. ``--their-exp clamped``
gives their FAVOR+ features' exponents the clamp that ``lifeseq_shards.performer.MIN_EXPONENT`` gives ours (the
same bits): the like-for-like comparison on a CPU, whose exp takes a slow path 10-25x longer where it underflows (a
GPU's has none); ``as-is`` (the default) times their model as they run it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lifeseq_shards.device.batch import PackedModelBatch
from lifeseq_shards.performer import MIN_EXPONENT, PackedPerformer
from tools.common import REPO, commit, sample_lengths
from tools.their_encoder import SIZES, TheirEncoder, TheirSize

# the researchers' sample as the repository carries it (byte-identical to ../shared's: tests/test_sample.py), so the
# bench runs in a fresh clone
SAMPLE = REPO / "tests" / "data" / "lifeseq-sample"
WIDTH = 512  # their max_length
TARGET_EVERY = 7  # an MLM target every 7th token: about their 15 %
PRECISIONS = ("fp32", "tf32", "bf16-mixed")
POPULATIONS = ("sample", "long-tail")


# ---- batches ----

def person_ids(lengths: list[int], vocab: int, seed: int) -> list[Tensor]:
    """(4, n) ids per person: token, abspos (days), age (years), segment."""
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randint(5, vocab, (n,), generator=g),
                         torch.randint(0, 16000, (n,), generator=g).sort().values,
                         torch.randint(18, 90, (n,), generator=g).sort().values,
                         torch.randint(1, 4, (n,), generator=g)]) for n in lengths]


def padded_batch(people: list[Tensor], width: int = WIDTH) -> tuple[Tensor, Tensor]:
    ids = torch.stack([F.pad(p, (0, width - p.shape[1])) for p in people])
    mask = (torch.arange(width, device=ids.device)[None] < torch.tensor([p.shape[1] for p in people],
                                                                         device=ids.device)[:, None]).long()
    return ids, mask


def packed_batch(people: list[Tensor], width: int = WIDTH) -> PackedModelBatch:
    counts = torch.tensor([p.shape[1] for p in people], device=people[0].device)
    return PackedModelBatch({"input_ids": torch.cat(people, 1), "cu_seqlens": F.pad(counts.cumsum(0), (1, 0)).int(),
                             "lengths": counts, "max_len": width})


def budget_batches(people: list[Tensor], tokens: int) -> list[list[Tensor]]:
    """``people`` in order, cut into runs of at most ``tokens`` real tokens (a token budget's batches)."""
    out: list[list[Tensor]] = [[]]
    used = 0
    for p in people:
        if out[-1] and used + p.shape[1] > tokens:
            out.append([])
            used = 0
        out[-1].append(p)
        used += p.shape[1]
    return out


def population(name: str, persons: int, seed: int) -> list[int]:
    """``persons`` lengths: the sample's (a random draw of them) or a long-tailed synthetic population."""
    rng = np.random.default_rng(seed)
    if name == "sample":
        lengths = sample_lengths(SAMPLE)
        return [int(n) for n in rng.choice(lengths, persons, replace=False)]
    return [int(n) for n in np.clip(rng.lognormal(np.log(90), 0.9, persons), 6, WIDTH).round()]


# ---- the steps ----

class Heads(nn.Module):
    """A decoder on the MLM rows and a 3-class head on each person's first token (the losses' cost, not theirs)."""

    def __init__(self, size: TheirSize) -> None:
        super().__init__()
        self.mlm, self.cls = nn.Linear(size.hidden, size.vocab), nn.Linear(size.hidden, 3)

    def loss(self, rows: Tensor, tokens: Tensor, first: Tensor) -> Tensor:
        return F.cross_entropy(self.mlm(rows), tokens) + F.cross_entropy(self.cls(first), torch.zeros(
            first.shape[0], dtype=torch.long))


def padded_states(model: TheirEncoder, people: list[Tensor]) -> list[Tensor]:
    states = model(*padded_batch(people))
    return [s[: p.shape[1]] for s, p in zip(states, people, strict=True)]


def packed_states(net: PackedPerformer, people: list[Tensor]) -> list[Tensor]:
    return list(net(packed_batch(people)).split([p.shape[1] for p in people]))


States = Callable[[list[Tensor]], list[Tensor]]


def step(states_of: States, people: list[Tensor], heads: Heads, opt: torch.optim.Optimizer | None,
         precision: str) -> None:
    """Their training step on ``people`` (``opt`` given), or their embedding pass (no grad, mean pooled), the
    forward under bf16 autocast for ``precision`` bf16-mixed."""
    device = people[0].device.type
    with torch.autocast(device, torch.bfloat16, enabled=precision == "bf16-mixed"), torch.set_grad_enabled(
            opt is not None):
        states = states_of(people)
        if opt is None:
            torch.stack([s.mean(0) for s in states])
            return
        rows = torch.cat([s[::TARGET_EVERY] for s in states])
        tokens = torch.cat([p[0, ::TARGET_EVERY] for p in people])
        loss = heads.loss(rows, tokens, torch.stack([s[0] for s in states]))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_pass(states_of: States, batches: list[list[Tensor]], heads: Heads, opt: torch.optim.Optimizer | None,
               precision: str) -> float:
    cuda = batches[0][0].is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for people in batches:
        step(states_of, people, heads, opt, precision)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_step(sides: list[tuple[str, States, list[list[Tensor]]]], heads: Heads, opt: torch.optim.Optimizer,
                 precision: str) -> None:
    """The top operators (by self time) of one training batch of each side."""
    from torch.profiler import profile

    for side, states_of, batches in sides:
        with profile() as prof:
            step(states_of, batches[0], heads, opt, precision)
        print(f"-- profile: one {side} training batch ({sum(p.shape[1] for p in batches[0])} real tokens)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


@dataclass
class Row:
    size: str
    population: str
    kind: str  # train | predict
    persons: int
    tokens: int
    padding: float
    padded_s: list[float]
    packed_s: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.padded_s, self.packed_s, strict=True)]

    @property
    def bar(self) -> float:
        return 0.8 / (1.0 - self.padding)

    @property
    def token_cost(self) -> float:
        """Packed seconds per real token over padded seconds per padded slot (median over rounds)."""
        return statistics.median(1.0 / (r * (1.0 - self.padding)) for r in self.ratios)

    def cells(self) -> list[str]:
        pad, pk = statistics.median(self.padded_s), statistics.median(self.packed_s)
        ratio = statistics.median(self.ratios)
        return [self.size, self.population, self.kind, f"{self.padding:.2f}", f"{self.persons / pad:.2f}",
                f"{self.persons / pk:.2f}", f"{self.tokens / pad:,.0f}", f"{self.tokens / pk:,.0f}",
                f"{ratio:.2f} ({min(self.ratios):.2f}-{max(self.ratios):.2f})", f"{self.bar:.2f}",
                "yes" if ratio >= self.bar else "no", f"{self.token_cost:.2f}"]


HEADER = ("| size | population | pass | padding | padded persons/s | packed persons/s | padded tokens/s | "
          "packed tokens/s | packed / padded (min-max) | bar | met | cost per token, packed / padded |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def check_agree(model: TheirEncoder, net: PackedPerformer, people: list[Tensor]) -> None:
    """The two forwards give the same states (eval mode), so the bench times the same computation."""
    model.eval()
    with torch.no_grad():
        for a, b in zip(padded_states(model, people), packed_states(net, people), strict=True):
            if float((a - b).norm()) > 1e-4 * float(b.norm()):
                raise SystemExit(f"bench_performer: padded and packed states differ for a person of {a.shape[0]} "
                                 "tokens")
    model.train()


def measure(size_name: str, pop: str, args: argparse.Namespace) -> list[Row]:
    size = SIZES[size_name]
    torch.manual_seed(0)
    model = TheirEncoder(size).to(args.device)
    with torch.no_grad():  # ReZero gains away from their start of 0, so that the check compares every term
        for name, p in model.named_parameters():
            if name.endswith(".weights"):
                p.fill_(0.5)
    net = PackedPerformer(model, pad_to=WIDTH, static=False)  # eager steps: the buckets counted on the host
    heads = Heads(size).to(args.device)
    opt = torch.optim.AdamW([*model.parameters(), *heads.parameters()], lr=1e-4)
    lengths = population(pop, args.persons, seed=0)
    people = [p.to(args.device) for p in person_ids(lengths, size.vocab, seed=1)]
    torch.backends.cuda.matmul.allow_tf32 = False
    check_agree(model, net, people[: args.batch])  # in fp32, whatever the precision timed
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"  # their set_float32_matmul_precision("medium")
    padded = [people[i:i + args.batch] for i in range(0, len(people), args.batch)]
    packed = budget_batches(people, args.batch * WIDTH)
    padding = 1.0 - sum(lengths) / (len(people) * WIDTH)  # every padded person has WIDTH slots
    sides = [("padded", lambda p: padded_states(model, p), padded), ("packed", lambda p: packed_states(net, p), packed)]
    if args.profile:
        profile_step(sides, heads, opt, args.precision)
    rows = []
    for kind, optimizer in (("train", opt), ("predict", None)):
        row = Row(size_name, pop, kind, len(people), sum(lengths), padding, [], [])
        model.train(kind == "train")
        for _, states_of, batches in sides:  # warm-up: first calls, allocator
            timed_pass(states_of, batches[:1], heads, optimizer, args.precision)
        for r in range(args.rounds):  # alternating, the first side swapped each round
            for side, states_of, batches in sides if r % 2 == 0 else sides[::-1]:
                (row.padded_s if side == "padded" else row.packed_s).append(
                    timed_pass(states_of, batches, heads, optimizer, args.precision))
        rows.append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
    return rows


def page(rows: list[Row], args: argparse.Namespace, measured: str, load: tuple[float, float]) -> str:
    where = f"CUDA ({torch.cuda.get_device_name()})" if args.device == "cuda" else (
        f"the CPU ({torch.get_num_threads()} thread(s); load average {load[0]:.1f} at the start, {load[1]:.1f} at "
        "the end)")
    return f"""# Their performer encoder, padded against packed (issue 39)

Measured by `python -m tools.bench_performer --sizes {",".join(args.sizes)} --populations \
{",".join(args.populations)} --persons {args.persons} --batch {args.batch} --rounds {args.rounds} --device \
{args.device} --precision {args.precision} --their-exp {args.their_exp}` at commit {measured}, torch \
{torch.__version__}, on {where}.

Method: their encoder's structure on their dependencies (tools/their_encoder.py `TheirEncoder`:
performer-pytorch 1.1.4 + local-attention 1.9.14, their edits; 10 heads of which 7 local with window
38, 436 random features) at their dims. Padded: {args.batch} persons a step, each padded to {WIDTH},
as their loader gives them. Packed: `PackedPerformer(model, pad_to={WIDTH}, static=False)` (the same numbers
as their padded model: checked before timing; the buckets its persons fill, counted on the host, as an eager step
without a static shape lays them out) on the same persons in order, in batches of at most
{args.batch} x {WIDTH} real tokens. "train" is their step (forward, an MLM decoder on every
{TARGET_EVERY}th token and a CLS head, backward, AdamW); "predict" the forward under no_grad and a
mean pool. After one untimed batch of each side, each round times every batch of the {args.persons}
persons once per side, the sides alternating (the first swapped each round); the ratio is the median
over {args.rounds} rounds of packed persons/s over padded persons/s (min-max beside it). The bar is
0.8 x 1 / (1 - padding fraction); the last column is packed seconds per real token over padded
seconds per padded slot (<= 1.25 meets the bar, 1.0 is the ceiling 1 / (1 - padding)). Populations:
`sample`, a draw of the lengths in tests/data/lifeseq-sample (their pipeline's output on fake
persons); `long-tail`, lognormal (median 90) capped at {WIDTH}.

{HEADER}
""" + "\n".join("| " + " | ".join(r.cells()) + " |" for r in rows) + """

The GPU numbers (fp32 + TF32 and bf16-mixed, small / medium / base: tools/device_check.sh's `their` stage) wait for
a GPU: none was lent to this run.
"""


class ClampedExp:
    """torch, as performer-pytorch's module sees it, with exp's argument clamped at ``MIN_EXPONENT`` (``--their-exp
    clamped``): their features are the same bits (exp(-30) + their eps is their eps), without the slow path."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def exp(x: Tensor) -> Tensor:
        return torch.exp(x.clamp(min=MIN_EXPONENT))


def names(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argument of comma-separated names, each one of ``known`` (refused before any model is built)."""
    def parse(text: str) -> list[str]:
        got = text.split(",")
        unknown = [n for n in got if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))}: not one of {', '.join(known)}")
        return got
    return parse


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=names(SIZES), default=["small", "medium"])
    ap.add_argument("--populations", type=names(POPULATIONS), default=list(POPULATIONS))
    # 64 persons of the sample (mean 136 tokens) fill two 4,096-token budget batches: the packed side runs full ones
    ap.add_argument("--persons", type=positive, default=64)
    ap.add_argument("--batch", type=positive, default=8, help="persons a padded step (their batch_size)")
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument("--profile", action="store_true", help="print one training step's top operators per side first")
    ap.add_argument("--their-exp", default="as-is", choices=("as-is", "clamped"),
                    help="clamped: their features' exponents clamped as ours are (the same bits, no slow path)")
    ap.add_argument("--out", type=Path, default=None, help="the results page to write (docs/results/performer.md)")
    args = ap.parse_args(argv)
    measured = commit()  # before the run: a commit made while it runs is not what it measured
    load = os.getloadavg()[0]
    print(HEADER, flush=True)
    import performer_pytorch.performer_pytorch as theirs

    kept = theirs.torch
    theirs.torch = ClampedExp() if args.their_exp == "clamped" else kept
    try:
        rows = [r for size in args.sizes for pop in args.populations for r in measure(size, pop, args)]
    finally:  # their module as it was, for whatever runs next in this process
        theirs.torch = kept
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page(rows, args, measured, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
