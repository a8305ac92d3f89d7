"""The researchers' performer encoder, padded to 512 as their loader gives it, against lifeseq_shards.performer's
packed forward of the same persons in token-budget batches: their training step (forward, backward, AdamW) and their
embedding (predict) pass, persons/s and tokens/s, in one run, the two taking turns round by round.

    python -m tools.bench_performer [--sizes small,medium] [--persons 32] [--batch 8] [--rounds 3]
                                    [--out docs/results/performer.md]

The model is their ``Transformer``'s structure built on their dependencies (:class:`TheirEncoder`: performer-pytorch
1.1.4's ``SelfAttention`` with local-attention 1.9.14's window, their edits; tests/test_performer.py checks it, and
``PackedPerformer``, against their own modules at 884ef02) at their small and medium dims. The padded side reads
``--batch`` persons a step, each padded to 512; the packed side (``PackedPerformer(model, pad_to=512)``, their
padded model's numbers) the same persons in order, cut into batches of at most ``--batch`` x 512 real tokens. Both
decode the same MLM rows (every 7th token of each person) and the CLS of each person's first token; before timing,
the two forwards are checked to agree. Two populations: the sample's lengths (tests/data/lifeseq-sample, their
pipeline's output) and a long-tailed synthetic one (lognormal, capped at 512). The ratio is the median over rounds
of packed persons/s over padded persons/s; the bar is 0.8 x 1 / (1 - padding fraction), the padding fraction that
of the padded batches.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from performer_pytorch import SelfAttention
from torch import Tensor, nn

from lifeseq_shards.device.batch import PackedModelBatch
from lifeseq_shards.performer import PackedPerformer
from tools.common import REPO, commit, sample_lengths

# the researchers' sample as the repository carries it (byte-identical to ../shared's: tests/test_sample.py), so the
# bench runs in a fresh clone
SAMPLE = REPO / "tests" / "data" / "lifeseq-sample"
WIDTH = 512  # their max_length
TARGET_EVERY = 7  # an MLM target every 7th token: about their 15 %


@dataclass(frozen=True)
class TheirSize:
    """Their hparams that shape the encoder (regular_hparams_*.txt): heads 10 with 7 local of window 38, 436
    random features."""

    hidden: int
    ff: int
    layers: int
    vocab: int
    heads: int = 10
    local: int = 7
    window: int = 38
    features: int = 436


SIZES = {"small": TheirSize(160, 1240, 3, 3000), "medium": TheirSize(280, 2210, 5, 3000),
         "tiny": TheirSize(40, 64, 2, 50, features=48)}


# ---- their encoder's structure on their dependencies (written from reading their code at 884ef02) ----

class Time2Vec(nn.Module):
    """Their PositionalEmbedding: f(tau w + b) beside tau w0 + b0."""

    def __init__(self, hidden: int, f: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.w0, self.b0 = nn.Parameter(torch.randn(1, 1)), nn.Parameter(torch.randn(1, 1))
        self.w, self.b = nn.Parameter(torch.randn(1, hidden - 1)), nn.Parameter(torch.randn(1, hidden - 1))
        self.f = f

    def forward(self, tau: Tensor) -> Tensor:
        return torch.cat([self.f(tau @ self.w + self.b), tau @ self.w0 + self.b0], -1)


class Gain(nn.Module):
    """Their ReZero: x + y * weight (their start: 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x + y * self.weights


class Embed(nn.Module):
    """Their Embeddings: token, then ReZero'd age and abspos (each sequence's first 5 positions zeroed), segment."""

    def __init__(self, size: TheirSize, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(size.vocab, size.hidden, padding_idx=0)
        self.segment = nn.Embedding(4, size.hidden, padding_idx=0)
        self.age, self.abspos = Time2Vec(size.hidden, torch.cos), Time2Vec(size.hidden, torch.sin)
        self.res_age, self.res_abs, self.res_seg = Gain(), Gain(), Gain()
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, position: Tensor, age: Tensor, segment: Tensor) -> Tensor:
        x = self.token(tokens)
        for res, emb, value in ((self.res_age, self.age, age), (self.res_abs, self.abspos, position)):
            pos = emb(value.float().unsqueeze(-1))
            pos[:, :5] *= 0
            x = res(x, pos)
        return self.dropout(self.res_seg(x, self.segment(segment)))


class Sublayer(nn.Module):
    """Their SublayerConnection with norm_type "rezero"."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = Gain()

    def forward(self, x: Tensor, sublayer: Callable[..., Tensor], **kwargs: object) -> Tensor:
        return self.norm(x, sublayer(x, **kwargs))


class Attention(nn.Module):
    """Their MultiHeadAttention around CustomSelfAttention: performer-pytorch's SelfAttention without the local
    heads' rotary embedding, the padding mask as mask and context mask."""

    def __init__(self, size: TheirSize, dropout: float) -> None:
        super().__init__()
        self.attention = SelfAttention(dim=size.hidden, heads=size.heads, nb_features=size.features,
                                       dim_head=size.hidden // size.heads, causal=False, generalized_attention=False,
                                       no_projection=False, dropout=dropout, local_heads=size.local, qkv_bias=False,
                                       attn_out_bias=True, local_window_size=size.window)
        self.attention.local_attn.rel_pos = None

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.attention(x, mask=mask.bool(), context_mask=mask.bool())


class FeedForward(nn.Module):
    """Their PositionWiseFeedForward (swish)."""

    def __init__(self, size: TheirSize, dropout: float) -> None:
        super().__init__()
        self.hidden2ff, self.ff2hidden = nn.Linear(size.hidden, size.ff), nn.Linear(size.ff, size.hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.ff2hidden(F.silu(self.dropout(self.hidden2ff(x))))


class Layer(nn.Module):
    def __init__(self, size: TheirSize, dropout: float) -> None:
        super().__init__()
        self.attention, self.attention_sublayer = Attention(size, dropout), Sublayer()
        self.position_wise, self.position_sublayer = FeedForward(size, dropout), Sublayer()

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attention_sublayer(x, sublayer=self.attention, mask=mask)
        return self.position_sublayer(x, sublayer=self.position_wise)


class TheirEncoder(nn.Module):
    """Their Transformer: embeddings, then per layer the hidden state times the padding mask and the layer;
    ``forward`` takes their padded batch, (B, 4, L) ids (token, abspos, age, segment) and the (B, L) mask."""

    def __init__(self, size: TheirSize, dropout: float = 0.1) -> None:
        super().__init__()
        self.embedding = Embed(size, dropout)
        self.encoders = nn.ModuleList(Layer(size, dropout) for _ in range(size.layers))

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        h = self.embedding(x[:, 0], x[:, 1], x[:, 2], x[:, 3])
        for layer in self.encoders:
            h = torch.einsum("bsh,bs->bsh", h, padding_mask.float())
            h = layer(h, padding_mask)
        return h


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
    mask = (torch.arange(width)[None] < torch.tensor([p.shape[1] for p in people])[:, None]).long()
    return ids, mask


def packed_batch(people: list[Tensor], width: int = WIDTH) -> PackedModelBatch:
    counts = torch.tensor([p.shape[1] for p in people])
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


def step(states: list[Tensor], people: list[Tensor], heads: Heads, opt: torch.optim.Optimizer | None) -> None:
    """Their training step on the states of ``people`` (``opt`` given), or their embedding pass (mean pooled)."""
    if opt is None:
        torch.stack([s.mean(0) for s in states])
        return
    rows = torch.cat([s[::TARGET_EVERY] for s in states])
    tokens = torch.cat([p[0, ::TARGET_EVERY] for p in people])
    heads.loss(rows, tokens, torch.stack([s[0] for s in states])).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_pass(states_of: Callable[[list[Tensor]], list[Tensor]], batches: list[list[Tensor]], heads: Heads,
               opt: torch.optim.Optimizer | None) -> float:
    start = time.perf_counter()
    for people in batches:
        if opt is None:
            with torch.no_grad():
                step(states_of(people), people, heads, None)
        else:
            step(states_of(people), people, heads, opt)
    return time.perf_counter() - start


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

    def cells(self) -> list[str]:
        pad, pk = statistics.median(self.padded_s), statistics.median(self.packed_s)
        ratio = statistics.median(self.ratios)
        return [self.size, self.population, self.kind, f"{self.padding:.2f}", f"{self.persons / pad:.2f}",
                f"{self.persons / pk:.2f}", f"{self.tokens / pad:,.0f}", f"{self.tokens / pk:,.0f}",
                f"{ratio:.2f} ({min(self.ratios):.2f}-{max(self.ratios):.2f})", f"{self.bar:.2f}",
                "yes" if ratio >= self.bar else "no"]


HEADER = ("| size | population | pass | padding | padded persons/s | packed persons/s | padded tokens/s | "
          "packed tokens/s | packed / padded (min-max) | bar | met |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


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
    model = TheirEncoder(size)
    with torch.no_grad():  # ReZero gains away from their start of 0, so that the check compares every term
        for name, p in model.named_parameters():
            if name.endswith(".weights"):
                p.fill_(0.5)
    net = PackedPerformer(model, pad_to=WIDTH)
    heads = Heads(size)
    opt = torch.optim.AdamW([*model.parameters(), *heads.parameters()], lr=1e-4)
    lengths = population(pop, args.persons, seed=0)
    people = person_ids(lengths, size.vocab, seed=1)
    check_agree(model, net, people[: args.batch])
    padded = [people[i:i + args.batch] for i in range(0, len(people), args.batch)]
    packed = budget_batches(people, args.batch * WIDTH)
    padding = 1.0 - sum(lengths) / (len(people) * WIDTH)  # every padded person has WIDTH slots
    rows = []
    for kind, optimizer in (("train", opt), ("predict", None)):
        row = Row(size_name, pop, kind, len(people), sum(lengths), padding, [], [])
        model.train(kind == "train")
        sides = [("padded", lambda p: padded_states(model, p), padded),
                 ("packed", lambda p: packed_states(net, p), packed)]
        for _, states_of, batches in sides:  # warm-up: first calls, allocator
            timed_pass(states_of, batches[:1], heads, optimizer)
        for r in range(args.rounds):  # alternating, the first side swapped each round
            for side, states_of, batches in sides if r % 2 == 0 else sides[::-1]:
                (row.padded_s if side == "padded" else row.packed_s).append(
                    timed_pass(states_of, batches, heads, optimizer))
        rows.append(row)
        print("| " + " | ".join(row.cells()) + " |", flush=True)
    return rows


def page(rows: list[Row], args: argparse.Namespace, measured: str) -> str:
    return f"""# Their performer encoder, padded against packed (issue 39)

Measured by `python -m tools.bench_performer --sizes {",".join(args.sizes)} --persons {args.persons} --batch \
{args.batch} --rounds {args.rounds}` at commit {measured}, torch {torch.__version__}, on
{"CUDA" if torch.cuda.is_available() else f"the CPU ({torch.get_num_threads()} threads)"}, fp32.

Method: their encoder's structure on their dependencies (tools/bench_performer.py `TheirEncoder`:
performer-pytorch 1.1.4 + local-attention 1.9.14, their edits; 10 heads of which 7 local with window
38, 436 random features) at their dims. Padded: {args.batch} persons a step, each padded to {WIDTH},
as their loader gives them. Packed: `PackedPerformer(model, pad_to={WIDTH})` (the same numbers as
their padded model: checked before timing) on the same persons in order, in batches of at most
{args.batch} x {WIDTH} real tokens. "train" is their step (forward, an MLM decoder on every
{TARGET_EVERY}th token and a CLS head, backward, AdamW); "predict" the forward under no_grad and a
mean pool. After one untimed batch of each side, each round times every batch of the {args.persons}
persons once per side, the sides alternating (the first swapped each round); the ratio is the median
over {args.rounds} rounds of packed persons/s over padded persons/s (min-max beside it). The bar is
0.8 x 1 / (1 - padding fraction). Populations: `sample`, a draw of the lengths in
tests/data/lifeseq-sample (their pipeline's output on fake persons); `long-tail`, lognormal
(median 90) capped at {WIDTH}.

{HEADER}
""" + "\n".join("| " + " | ".join(r.cells()) + " |" for r in rows) + """

The GPU numbers (fp32 + TF32 and bf16-mixed, small / medium / base) wait for a GPU: none was lent to this run.
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: s.split(","), default=["small", "medium"])
    ap.add_argument("--populations", type=lambda s: s.split(","), default=["sample", "long-tail"])
    ap.add_argument("--persons", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="persons a padded step (their batch_size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="the results page to write (docs/results/performer.md)")
    args = ap.parse_args(argv)
    measured = commit()  # before the run: a commit made while it runs is not what it measured
    print(HEADER, flush=True)
    rows = [r for size in args.sizes for pop in args.populations for r in measure(size, pop, args)]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page(rows, args, measured))


if __name__ == "__main__":
    main()
