"""lifeseq_shards.performer.PackedPerformer against the researchers' padded encoder.

Two references: their encoder's structure built on their dependencies (tools/their_encoder.py ``TheirEncoder``:
performer-pytorch 1.1.4's ``SelfAttention`` with local-attention 1.9.14's ``LocalAttention``, the extra ``their``),
with their edits reproduced as their code makes them (no rotary embedding on the local heads, the padding mask as
the global heads' context mask); and, where their
repository is at hand (THEIR_REPO, or the fetched mirror, as tools/seed_bench.py finds it), their own ``Transformer``
at 884ef02. Tiny widths and few persons, their head layout (10 heads, 7 local, window 38), lengths across buckets.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import THEIR_MIRROR, their_code, their_repo
from performer_pytorch import FastAttention
from torch import Tensor, nn

from lifeseq_shards import performer
from lifeseq_shards.device.batch import PackedModelBatch, StaticModelBatch
from lifeseq_shards.device.build import StaticShape, count_tokens, host_sync_guard, model_batch
from lifeseq_shards.performer import PackedPerformer, bucket_count, global_heads, packed_layout
from lifeseq_shards.reader import ShardedDataset
from tools.their_encoder import SIZES, TheirEncoder

TINY = SIZES["tiny"]
HIDDEN, FF, LAYERS, HEADS, LOCAL, WINDOW, FEATURES, VOCAB = (TINY.hidden, TINY.ff, TINY.layers, TINY.heads, TINY.local,
                                                             TINY.window, TINY.features, TINY.vocab)
THEIR_COMMIT = "884ef02"


def reference(seed: int = 0, dropout: float = 0.0, vocab: int = VOCAB) -> TheirEncoder:
    """Their encoder's structure on their dependencies (tools/bench_performer.py), its ReZero gains away from their
    start of 0 and its token embedding wider than their init, so that every term counts and attention is not
    uniform."""
    torch.manual_seed(seed)
    model = TheirEncoder(replace(SIZES["tiny"], vocab=vocab), dropout)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith(".weights"):
                p.fill_(0.2 + 0.1 * (i % 5))
        model.embedding.token.weight.normal_(0, 1.0)
        model.embedding.token.weight[0].zero_()
    return model


# ---- batches ----

def persons(lengths: list[int], seed: int = 1) -> list[Tensor]:
    """(4, n) ids per person: token, abspos (days), age (years), segment."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        out.append(torch.stack([torch.randint(1, VOCAB, (n,), generator=g),
                                torch.randint(0, 3000, (n,), generator=g).sort().values,
                                torch.randint(18, 90, (n,), generator=g).sort().values,
                                torch.randint(1, 4, (n,), generator=g)]))
    return out


def packed(people: list[Tensor], max_len: int, filler: list[int] = ()) -> PackedModelBatch:
    """The packed model batch of ``people``; ``filler``: a static batch's padding persons (lengths 0, [PAD] rows of
    all-zero stamps; 0 rows: a person without any)."""
    counts = [p.shape[1] for p in people] + list(filler)
    ids = torch.cat([*people, torch.zeros(4, sum(filler), dtype=torch.long)], 1)
    return PackedModelBatch({"input_ids": ids, "cu_seqlens": F.pad(torch.tensor(counts).cumsum(0), (1, 0)).int(),
                             "lengths": torch.tensor([p.shape[1] for p in people] + [0] * len(filler)),
                             "max_len": max_len})


def padded(people: list[Tensor], width: int) -> tuple[Tensor, Tensor]:
    ids = torch.stack([F.pad(p, (0, width - p.shape[1])) for p in people])
    mask = (torch.arange(width)[None] < torch.tensor([p.shape[1] for p in people])[:, None]).long()
    return ids, mask


def split(states: Tensor, people: list[Tensor]) -> list[Tensor]:
    return list(states[: sum(p.shape[1] for p in people)].split([p.shape[1] for p in people]))


def relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


LENGTHS = [1, 5, 6, 37, 38, 39, 77, 120]


# ---- the tests ----

@pytest.mark.parametrize("width", [128, 512])
def test_pad_to_equals_their_padded_forward(width: int) -> None:
    """pad_to=L: every person's states are their padded-to-L forward's (<= 1e-5 relative); L=128 is not a multiple
    of the window (their autopad). And the mode matters: the same persons without padding keys differ."""
    model = reference().eval()
    people = persons(LENGTHS + [width])
    with torch.no_grad():
        theirs = model(*padded(people, width))
        ours = PackedPerformer(model, pad_to=width)(packed(people, width))
        alone = PackedPerformer(model, pad_to=None)(packed(people, width))
    for i, (got, free, p) in enumerate(zip(split(ours, people), split(alone, people), people, strict=True)):
        want = theirs[i, : p.shape[1]]
        assert relative(got, want) <= 1e-5, (i, p.shape[1], relative(got, want))
        if p.shape[1] < width // 2:  # their padding keys damp the global heads
            assert relative(free, want) > 1e-3, (i, p.shape[1])
    assert relative(split(alone, people)[-1], theirs[-1]) <= 1e-5  # a full-length person has no padding key


def test_no_padding_keys_equals_each_person_alone() -> None:
    """pad_to=None: each person's states are their model's on that person alone, unpadded (<= 1e-5 relative)."""
    model = reference().eval()
    people = persons(LENGTHS + [200])
    with torch.no_grad():
        ours = split(PackedPerformer(model, pad_to=None)(packed(people, 256)), people)
        for got, p in zip(ours, people, strict=True):
            want = model(p[None], torch.ones(1, p.shape[1], dtype=torch.long))[0]
            assert relative(got, want) <= 1e-5, (p.shape[1], relative(got, want))


@pytest.mark.parametrize("pad_to", [None, 256])
def test_a_person_never_depends_on_the_others(pad_to: int | None) -> None:
    """Changing one person's tokens and length leaves every other person's states bit-identical."""
    model = reference().eval()
    people = persons(LENGTHS)
    other = list(people)
    other[3] = persons([90], seed=7)[0]
    with torch.no_grad():
        a = split(PackedPerformer(model, pad_to=pad_to)(packed(people, 256)), people)
        b = split(PackedPerformer(model, pad_to=pad_to)(packed(other, 256)), other)
    for i in range(len(people)):
        if i != 3:
            assert torch.equal(a[i], b[i]), i
    assert not torch.equal(a[3][:37], b[3][:37])


@pytest.mark.parametrize("pad_to", [None, 128])
def test_filler_rows_give_no_nan_and_change_nothing(pad_to: int | None) -> None:
    """A static batch's padding persons ([PAD] rows, lengths 0; one without rows): finite states and gradients, the
    real persons' states as without them."""
    model = reference().train()
    people = persons([3, 40, 90])
    net = PackedPerformer(model, pad_to=pad_to)
    out = net(packed(people, 128, filler=[128, 57, 0]))
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    with torch.no_grad():
        plain = net(packed(people, 128))
    assert relative(out[:133].detach(), plain) <= 1e-6


def _loss(states: list[Tensor], head: nn.Linear) -> Tensor:
    """An MLM-like loss: a decoder on every third token of each person, and a 3-class head on the first."""
    targets = torch.cat([s[::3] for s in states])
    mlm = F.cross_entropy(head(targets), torch.arange(targets.shape[0]) % VOCAB)
    cls = torch.stack([s[0] for s in states]).sum(-1)
    return mlm + cls.square().mean()


def _grads(model: nn.Module) -> dict[str, Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("width", [128, 512])
def test_gradients_equal_the_padded_models(width: int) -> None:
    """A training loss's gradients through pad_to=L equal their padded model's (<= 1e-4 relative, each parameter;
    train mode, dropout off); at L=512, their max_length, the padding keys are most of each person's keys."""
    model = reference().train()
    head = nn.Linear(HIDDEN, VOCAB)
    people = persons(LENGTHS, seed=3)
    ids, mask = padded(people, width)
    _loss([s[: p.shape[1]] for s, p in zip(model(ids, mask), people, strict=True)], head).backward()
    want = _grads(model)
    _loss(split(PackedPerformer(model, pad_to=width)(packed(people, width)), people), head).backward()
    got = _grads(model)
    assert got.keys() == want.keys() and len(want) > 20
    for name, g in want.items():
        scale = max(float(g.norm()), 1e-12)
        assert float((got[name] - g).norm()) / scale <= 1e-4, (name, float((got[name] - g).norm()) / scale)


def test_redraw_and_steps_are_shared() -> None:
    """The module is held, not copied: a projection redraw through their module, and an optimizer step through the
    packed one, each change both, which still agree afterwards."""
    model = reference().eval()
    net = PackedPerformer(model, pad_to=128)
    assert {id(p) for p in net.parameters()} == {id(p) for p in model.parameters()}
    people = persons([10, 60, 100])
    batch, (ids, mask) = packed(people, 128), padded(people, 128)

    def agree() -> Tensor:
        with torch.no_grad():
            ours, theirs = split(net(batch), people), model(ids, mask)
        for i, got in enumerate(ours):
            assert relative(got, theirs[i, : got.shape[0]]) <= 1e-5
        return torch.cat(ours)

    before = agree()
    for layer in model.encoders:
        layer.attention.attention.fast_attention.redraw_projection_matrix("cpu")
    redrawn = agree()
    assert not torch.allclose(before, redrawn)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(batch).square().mean().backward()
    opt.step()
    assert not torch.allclose(redrawn, agree())


@pytest.mark.parametrize("pad_to", [None, 16])
def test_global_heads_key_stabiliser_counts_the_padding_keys_zero(pad_to: int | None) -> None:
    """The global heads alone against performer-pytorch's FastAttention on the padded keys (padding keys 0, their
    values 0), with keys whose every projection is negative: the stabiliser is then the padding keys' 0 (their
    maximum over the padded person), not the real keys' maximum, and the eps term shows it."""
    fast = FastAttention(4, nb_features=2)
    fast.projection_matrix.copy_(torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0]]))
    g = torch.Generator().manual_seed(0)
    counts = [3, 7]
    q = torch.randn(sum(counts), 2, 4, generator=g)
    k = -(torch.rand(sum(counts), 2, 4, generator=g) + 8.0) * torch.tensor([1.0, 1, 0, 0])  # projections < 0
    v = torch.randn(sum(counts), 2, 4, generator=g)
    cu = F.pad(torch.tensor(counts).cumsum(0), (1, 0)).int()
    layout = packed_layout(cu, sum(counts), 5, 1, 1, pad_to)
    buckets = layout.key_cells.shape[0]
    q, k, v = (t[layout.cell_row].unflatten(0, (buckets, -1)) for t in (q, k, v))
    ours = global_heads(q, k, v, layout, fast.projection_matrix).flatten(0, 1)[layout.row_cell]
    q, k, v = (t.flatten(0, 1)[layout.row_cell] for t in (q, k, v))
    for start, n in zip(cu[:-1].tolist(), counts, strict=True):
        width = n if pad_to is None else pad_to
        qp, kp, vp = (F.pad(t[start:start + n], (0, 0, 0, 0, 0, width - n)).transpose(0, 1)[None] for t in (q, k, v))
        want = fast(qp, kp, vp)[0].transpose(0, 1)[:n]
        assert relative(ours[start:start + n], want) <= 1e-5, (n, relative(ours[start:start + n], want))


@pytest.mark.parametrize("bf16", [False, True])
def test_the_clamped_exponents_change_no_bit(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    """performer.MIN_EXPONENT clamps the features' exponents (the CPU's exp is 10-25x slower where it underflows):
    with keys and queries wide enough that many exponents fall below it, the global heads' output is the same bits
    as without the clamp (fp32, and under bf16 autocast, their precisions)."""
    g = torch.Generator().manual_seed(3)
    counts = [30, 77, 5]
    projection = torch.randn(FEATURES, 8, generator=g)
    q, k, v = (torch.randn(sum(counts), 3, 8, generator=g).mul(s) for s in (6.0, 6.0, 1.0))
    layout = packed_layout(F.pad(torch.tensor(counts).cumsum(0), (1, 0)).int(), sum(counts), WINDOW, 1, 1, 128)
    buckets = layout.key_cells.shape[0]
    q, k, v = (t[layout.cell_row].unflatten(0, (buckets, -1)) for t in (q, k, v))
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        clamped = global_heads(q, k, v, layout, projection)
        monkeypatch.setattr(performer, "MIN_EXPONENT", -math.inf)
        unclamped = global_heads(q, k, v, layout, projection)
    dash, diag = performer.feature_logits(k, projection)
    assert float((dash - diag - dash.amax()).lt(-30).float().mean()) > 0.3  # the clamp acted on many
    assert torch.equal(unclamped, clamped)


def test_the_devices_batches_padded_static_and_packed(nomlm_dataset: Path) -> None:
    """A batch read from shards and built by device.build.model_batch: packed, and packed to a StaticShape (filler
    persons), through PackedPerformer(pad_to=128) equal the padded model batch of the same persons through their
    model (the fields' order and the crop as the device lays them out)."""
    host = next(iter(ShardedDataset(nomlm_dataset, split="train", batch_size=12, seed=0, packed=True)))
    counted = count_tokens(host.with_buffer(torch.from_numpy(host.buffer)), 128)
    vocab = 3000
    model = reference(vocab=vocab).eval()
    pad = model_batch(counted, layout="padded", max_len=128)
    flat = model_batch(counted, layout="packed", max_len=128)
    static = model_batch(counted, layout="packed", max_len=128,
                         static=StaticShape(tokens=counted.n_tokens + 300, persons=12))
    assert static["cu_seqlens"].shape[0] > flat["cu_seqlens"].shape[0]  # filler persons
    lengths = pad["lengths"].long().clamp(max=128)
    assert int(pad["input_ids"][:, 0].max()) < vocab and int(lengths.min()) < 128
    net = PackedPerformer(model, pad_to=128)
    with torch.no_grad():
        theirs = model(pad["input_ids"].long(), pad["padding_mask"])
        ours, filled = net(flat), net(static)
    assert torch.isfinite(filled).all()
    for i, (got, n) in enumerate(zip(ours.split(lengths.tolist()), lengths.tolist(), strict=True)):
        assert relative(got, theirs[i, :n]) <= 1e-5, (i, n)
    assert relative(filled[: ours.shape[0]], ours) <= 1e-6


def test_static_batches_have_one_shape_and_no_host_sync() -> None:
    """Two static batches (same rows and persons, other persons in them) run forward and backward with no pull to the
    host, and every tensor of their layouts has the same shape (what a compiled step and a CUDA graph need)."""
    model = reference().train()
    net = PackedPerformer(model, pad_to=128)
    a = packed(persons([3, 40, 90, 20], seed=1), 128, filler=[7, 0])
    b = packed(persons([120, 2, 1, 30], seed=2), 128, filler=[7, 0])
    assert a["input_ids"].shape == b["input_ids"].shape and a["cu_seqlens"].shape == b["cu_seqlens"].shape
    with host_sync_guard():
        for batch in (a, b):
            net(batch).square().sum().backward()
    layouts = [packed_layout(x["cu_seqlens"], x["input_ids"].shape[1], WINDOW, 1, 1, 128) for x in (a, b)]
    assert [t.shape for t in layouts[0]] == [t.shape for t in layouts[1]]


@pytest.mark.parametrize("pad_to", [None, 128])
def test_exact_buckets_equal_their_model(pad_to: int | None) -> None:
    """static=False lays out only the buckets the persons fill (fewer than the static bound): the states are their
    padded forward's (pad_to=L) or each person's alone (None), <= 1e-5 relative; a training loss's gradients are
    their padded model's (<= 1e-4 relative); a filler person without rows gives no NaN."""
    model = reference().train()
    people = persons(LENGTHS, seed=3)
    batch = packed(people, 128)
    exact = packed_layout(batch["cu_seqlens"], batch["input_ids"].shape[1], WINDOW, 1, 1, pad_to,
                          bucket_count(batch["cu_seqlens"], WINDOW))
    bound = packed_layout(batch["cu_seqlens"], batch["input_ids"].shape[1], WINDOW, 1, 1, pad_to)
    assert exact.key_cells.shape[0] == sum(-(-n // WINDOW) for n in LENGTHS) < bound.key_cells.shape[0]
    net = PackedPerformer(model, pad_to=pad_to, static=False)
    with torch.no_grad():
        model.eval()
        ours = split(net(batch), people)
        theirs = model(*padded(people, 128)) if pad_to else None
        for i, (got, p) in enumerate(zip(ours, people, strict=True)):
            want = theirs[i, : p.shape[1]] if pad_to else model(p[None], torch.ones(1, p.shape[1], dtype=torch.long))[0]
            assert relative(got, want) <= 1e-5, (p.shape[1], relative(got, want))
        model.train()
    head = nn.Linear(HIDDEN, VOCAB)
    if pad_to:
        _loss([s[: p.shape[1]] for s, p in zip(model(*padded(people, 128)), people, strict=True)], head).backward()
        want = _grads(model)
        _loss(split(net(batch), people), head).backward()
        for name, g in _grads(model).items():
            assert float((g - want[name]).norm()) / max(float(want[name].norm()), 1e-12) <= 1e-4, name
    out = net(packed(people, 128, filler=[40, 0]))
    out.square().sum().backward()
    assert torch.isfinite(out).all() and all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_exact_buckets_read_the_host_only_without_a_static_shape() -> None:
    """static=False reads the lengths back to the host, except on a StaticModelBatch, which keeps its one shape."""
    net = PackedPerformer(reference().eval(), pad_to=128, static=False)
    batch = packed(persons([3, 40, 90]), 128, filler=[7, 0])
    with torch.no_grad(), host_sync_guard():
        with pytest.raises(RuntimeError, match="host sync"):
            net(batch)
        net(StaticModelBatch(dict(batch)))


def test_a_batch_wider_than_pad_to_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pad_to=128\) got a batch of persons up to max_len=512"):
        PackedPerformer(reference(), pad_to=128)(packed(persons([10]), 512))


# ---- their own modules at 884ef02, where their repository is at hand ----

@pytest.fixture(scope="module")
def their_transformer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type]:
    repo = their_repo()
    if repo is None:
        pytest.skip(f"their repository is not here ({THEIR_MIRROR}, or THEIR_REPO): the package-built reference above "
                    "stands for their modules")
    dest = tmp_path_factory.mktemp("their")
    archive = subprocess.run(["git", "-C", str(repo), "archive", THEIR_COMMIT, "pop2vec/__init__.py",
                              "pop2vec/llm/src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    with their_code(dest):
        from pop2vec.llm.src.transformer.transformer import Transformer
        yield Transformer


def their_hparams(**over: object) -> SimpleNamespace:
    """Their regular_hparams_medium.txt's settings at tiny dims (dropouts off: the comparison is in eval mode)."""
    base = dict(hidden_size=HIDDEN, hidden_ff=FF, n_encoders=LAYERS, n_heads=HEADS, n_local=LOCAL,
                local_window_size=WINDOW, num_random_features=FEATURES, norm_type="rezero", hidden_act="swish",
                att_dropout=0.1, fw_dropout=0.1, emb_dropout=0.1, parametrize_emb=True, norm_input_emb=False,
                attention_type="performer", vocab_size=VOCAB, epsilon=1e-6)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("width", [100, 512])
def test_their_own_modules(their_transformer: type, width: int) -> None:
    """Their Transformer at 884ef02 (ReZero gains set away from their 0 start, so every term counts): pad_to=L
    equals their padded forward, pad_to=None their forward of each person alone (<= 1e-5 relative)."""
    torch.manual_seed(0)
    model = their_transformer(their_hparams()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weights"):  # ReZero gains
                p.fill_(0.5)
    people = persons([1, 5, 9, 38, 70, width], seed=5)
    with torch.no_grad():
        theirs = model(*padded(people, width))
        ours = split(PackedPerformer(model, pad_to=width)(packed(people, width)), people)
        free = split(PackedPerformer(model, pad_to=None)(packed(people, width)), people)
        for i, p in enumerate(people):
            n = p.shape[1]
            assert relative(ours[i], theirs[i, :n]) <= 1e-5, (n, relative(ours[i], theirs[i, :n]))
            alone = model(p[None], torch.ones(1, n, dtype=torch.long))[0]
            assert relative(free[i], alone) <= 1e-5, (n, relative(free[i], alone))
    assert math.isfinite(float(theirs.sum()))
