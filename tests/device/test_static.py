"""Static shapes for token-budget batches (device.shape.StaticShape): a packed model batch padded to one shape whatever
it holds, the real persons' outputs, losses and gradients those of the unpadded batch, zero-length persons in both
attention backends, and a compiled training step that compiles once over an epoch."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lifeseq_shards import encoder as encoder_mod
from lifeseq_shards.device.batch import NO_CLS, PackedBatch, PackedModelBatch, StaticModelBatch
from lifeseq_shards.device.build import BatchBuilder, count_tokens, model_batch, to_device
from lifeseq_shards.device.shape import PACKED, PADDED, Padding, StaticShape
from lifeseq_shards.encoder import EncoderConfig, LifeSeqEncoder, Packed, varlen_attention
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import pretrain_losses
from lifeseq_shards.reader import ShardedDataset
from lifeseq_shards.store.remote import read_manifest
from tools.bench_static import budget_batches, model_batches, run_epoch

WIDTH = 344  # the sample's longest person (340) rounded up to 8: nobody cropped


def _hosts(root: Path, sizes: tuple[int, ...]) -> list[PackedBatch]:
    """One packed host batch of each size (persons), counted for WIDTH."""
    return [count_tokens(next(iter(ShardedDataset(root, split="train", batch_size=k, seed=k, packed=True))), WIDTH)
            for k in sizes]


def _both(host: PackedBatch, static: StaticShape, masker: DynamicMasker | None = None
          ) -> tuple[PackedModelBatch, PackedModelBatch]:
    """(unpadded, static) model batches of ``host``."""
    dev = to_device(host, "cpu")
    return (model_batch(dev, masker, layout=PACKED, max_len=WIDTH),
            model_batch(dev, masker, layout=PACKED, max_len=WIDTH, static=static))


def _losses_and_grads(model: torch.nn.Module, batch: PackedModelBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    mlm, cls = pretrain_losses(model, batch)
    (mlm + cls).backward()
    return torch.stack([mlm, cls]).detach(), [p.grad.clone() for p in model.parameters()]


def test_refusals() -> None:
    with pytest.raises(ValueError, match="persons=0"):
        StaticShape(100, 0)
    with pytest.raises(ValueError, match="persons=101"):
        StaticShape(100, 101)
    with pytest.raises(ValueError, match="layout='padded'"):
        Padding(PADDED, 64, StaticShape(100, 3))
    with pytest.raises(ValueError, match="set it to the longest person"):
        Padding(PACKED, None, StaticShape(100, 3))
    with pytest.raises(ValueError, match="layout='padded'"):
        BatchBuilder(None, PADDED, 64, StaticShape(100, 3))  # refused when built, not at its first batch
    assert Padding(PACKED, 64, StaticShape(100, 3)).max_len == 64


def test_rows_hold_the_padding_tokens() -> None:
    """rows(width): the most real persons, and enough padding persons of at most ``width`` tokens for the tokens
    the fewest real tokens (one a person) leave."""
    assert StaticShape(100, 3).rows(10) == 3 + 10  # 97 padding tokens in 10 persons of <= 10
    assert StaticShape(100, 100).rows(10) == 100
    assert StaticShape(64, 1).rows(64) == 2


@pytest.mark.parametrize("masking", ["dynamic", "none"])
def test_static_batches_have_one_shape_and_the_unpadded_contents(vocab_dataset: Path, masking: str) -> None:
    hosts = _hosts(vocab_dataset, (3, 11, 7))
    static = StaticShape(max(h.n_tokens for h in hosts) + 50, 11)
    vocab = read_manifest(vocab_dataset).vocab_size
    masker = DynamicMasker(MaskingConfig(vocab_size=vocab)) if masking == "dynamic" else None
    rows, shapes = static.rows(WIDTH), set()
    for host in hosts:
        plain, got = _both(host, static, masker)
        b, n = len(plain["lengths"]), host.n_tokens
        assert isinstance(got, StaticModelBatch)
        shapes.add(tuple((k, tuple(v.shape)) for k, v in got.items() if isinstance(v, torch.Tensor)))
        assert got["input_ids"].shape == (4, static.tokens) and got["lengths"].shape == (rows,)
        assert torch.equal(got["input_ids"][:, :n], plain["input_ids"])
        assert not got["input_ids"][:, n:].any() and not got["original_sequence"][n:].any()
        cu = got["cu_seqlens"].long()
        assert torch.equal(cu[: b + 1], plain["cu_seqlens"].long()) and int(cu[-1]) == static.tokens
        assert cu.diff().min() >= 0 and cu.diff().max() <= WIDTH  # padding persons within the width
        assert not got["lengths"][b:].any() and torch.equal(got["lengths"][:b], plain["lengths"])
        assert torch.equal(got["person_id"][:b], plain["person_id"])
        if masker is None:
            assert "target_index" not in got and "target_cls" not in got
            continue
        # the batch's targets, not a person's: the used targets first, in person order, then unused ones (token 0)
        assert got["target_index"].shape == got["target_tokens"].shape == (1, math.floor(0.3 * static.tokens))
        used = plain["target_tokens"] != 0
        k = int(used.sum())
        assert torch.equal(got["target_index"][0, :k], plain["target_index"][used])
        assert torch.equal(got["target_tokens"][0, :k], plain["target_tokens"][used])
        assert k and not got["target_tokens"][0, k:].any()
        assert torch.equal(got["target_cls"][:b], plain["target_cls"]) and (got["target_cls"][b:] == NO_CLS).all()
    assert len(shapes) == 1  # every batch, whatever it holds


@pytest.mark.parametrize("spare", [0, 1, 700])
def test_static_losses_and_gradients_are_the_unpadded_ones(vocab_dataset: Path, spare: int) -> None:
    """spare: padding tokens beyond the batch's real ones. 0: every padding person holds no token (they start past
    the last row: the CLS index is clamped); 700: some hold WIDTH tokens, the rest none."""
    torch.manual_seed(0)
    vocab = read_manifest(vocab_dataset).vocab_size
    model = LifeSeqEncoder(EncoderConfig(32, 48, 2, 4), vocab, dropout=0.0)
    host, = _hosts(vocab_dataset, (6,))
    plain, got = _both(host, StaticShape(host.n_tokens + spare, 9), DynamicMasker(MaskingConfig(vocab_size=vocab)))
    assert len(got["lengths"]) > len(plain["lengths"])
    loss_plain, grads_plain = _losses_and_grads(model, plain)
    loss_static, grads_static = _losses_and_grads(model, got)
    assert (plain["target_tokens"] != 0).any()  # the MLM loss has something to mean
    torch.testing.assert_close(loss_static, loss_plain, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_static, grads_plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_offline_targets_in_a_static_batch(mlm_dataset: Path) -> None:
    """The stored masks: floor(0.3 x 2048) target columns for the batch, the real persons' targets as unpadded; a
    width whose target columns cannot hold a person's stored targets is refused, not cropped."""
    host = next(iter(ShardedDataset(mlm_dataset, split="train", batch_size=5, seed=1, packed=True)))
    plain, got = _both(count_tokens(host, WIDTH), StaticShape(2048, 8))
    b = len(plain["lengths"])
    assert got["target_index"].shape == (1, math.floor(0.3 * 2048))
    used = plain["target_tokens"] != 0
    k = int(used.sum())
    assert k and torch.equal(got["target_tokens"][0, :k], plain["target_tokens"][used])
    assert torch.equal(got["target_index"][0, :k], plain["target_index"][used])
    assert (got["target_cls"][b:] == NO_CLS).all()
    narrow = count_tokens(host, 16)
    with pytest.raises(ValueError, match="offline MLM targets, more than the static shape's 4 target columns"):
        model_batch(to_device(narrow, "cpu"), layout=PACKED, max_len=16, static=StaticShape(2048, 8))


def test_a_batch_larger_than_the_shape_is_refused(vocab_dataset: Path) -> None:
    host, = _hosts(vocab_dataset, (6,))
    with pytest.raises(ValueError, match=r"6 persons and \d+ tokens does not fit StaticShape\(tokens=10, persons=3"):
        model_batch(to_device(host, "cpu"), layout=PACKED, max_len=WIDTH, static=StaticShape(10, 3))
    builder = BatchBuilder(None, PACKED, WIDTH, StaticShape(host.n_tokens, 6))
    assert isinstance(builder(host, "cpu", 0), StaticModelBatch)


def _reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k):
    """A stand-in for FlashAttention's varlen kernel, person by person; like it, it writes no row of a person
    without tokens (none exists) and leaves the output it does not write as it was allocated (here: NaN)."""
    out = torch.full_like(q, float("nan"))
    bounds = cu_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > a:
            out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    return out


@pytest.mark.parametrize("backend", ["padded-sdpa", "flash-varlen"])
def test_zero_length_persons_change_nothing_for_the_real_ones(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention over real persons, then padding persons of 0, 4, 0, 3, 0 tokens (a static batch's): the real rows'
    outputs and the gradients they pass back are those without the padding, and every gradient is finite, on either
    backend (padded-sdpa: on torch < 2.5 SDPA gives NaN for a person with no key at all, and so did its backward)."""
    if backend == "flash-varlen":  # the CUDA path's own code against a stand-in kernel, on CPU
        monkeypatch.setattr(encoder_mod, "_VARLEN_ATTN", _reference_kernel)
        monkeypatch.setattr(encoder_mod, "varlen_backend", lambda _q: backend)
    real, pad = [5, 1, 7], [0, 4, 0, 3, 0]
    n, total = sum(real), sum(real) + sum(pad)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, total, 2, 8, generator=g, requires_grad=True)
    cu = lambda lengths: F.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0)).int()  # noqa: E731
    weight = torch.randn(n, 2, 8, generator=g)
    out_pad = varlen_attention(*qkv, Packed(cu(real + pad), 8))
    (out_pad[:n] * weight).sum().backward()
    # every row's gradient finite, the padding rows' too: in the model they reach the weights
    assert torch.isfinite(qkv.grad).all()
    grad_pad = qkv.grad[:, :n].clone()
    qkv.grad = None
    out = varlen_attention(*qkv[:, :n], Packed(cu(real), 8))
    (out * weight).sum().backward()
    torch.testing.assert_close(out_pad[:n], out, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out_pad).all()
    torch.testing.assert_close(grad_pad, qkv.grad[:, :n], rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_cuda_static_batch_in_bf16(vocab_dataset: Path) -> None:
    """On CUDA in bf16 (FlashAttention's varlen kernel where torch has it): the static batch's losses and gradients
    are the unpadded batch's."""
    torch.manual_seed(0)
    vocab = read_manifest(vocab_dataset).vocab_size
    model = LifeSeqEncoder(EncoderConfig(64, 96, 2, 1), vocab, dropout=0.0).cuda()
    host, = _hosts(vocab_dataset, (6,))
    masker = DynamicMasker(MaskingConfig(vocab_size=vocab))
    dev = to_device(host, "cuda")
    plain = model_batch(dev, masker, layout=PACKED, max_len=WIDTH)
    got = model_batch(dev, masker, layout=PACKED, max_len=WIDTH, static=StaticShape(host.n_tokens + 700, 9))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_plain, grads_plain = _losses_and_grads(model, plain)
        loss_static, grads_static = _losses_and_grads(model, got)
    torch.testing.assert_close(loss_static, loss_plain, rtol=1e-2, atol=1e-2)
    for a, b in zip(grads_static, grads_plain, strict=True):
        assert torch.isfinite(a).all() and (a - b).norm() <= 5e-2 * b.norm() + 1e-6


@pytest.mark.slow
def test_a_compiled_step_compiles_once_over_a_static_epoch(vocab_dataset: Path) -> None:
    """The reference training step (LifeSeqPretrainModule.training_step, backward, AdamW) compiled (aot_eager:
    dynamo and autograd's tracing, no code generation) over a whole token-budget epoch of the val split: one
    compile with the static shape, more without it (each new person count, token count or width); the losses of
    both the same, step by step."""
    batches, static, width = budget_batches(vocab_dataset, "val", 8 * 340)  # 19 steps
    assert len(batches) >= 10 and len({b.n_tokens for b in batches}) > 1
    vocab = read_manifest(vocab_dataset).vocab_size
    tiny = EncoderConfig(16, 32, 1, 2)
    runs = {name: run_epoch(model_batches(batches, vocab, width, shape), vocab, "aot_eager", tiny)
            for name, shape in (("static", static), ("varying", None))}
    assert runs["static"]["compiles"] == 1 and runs["static"]["compiled_at"] == [0]
    assert runs["varying"]["compiles"] > 1
    np.testing.assert_allclose(runs["static"]["losses"], runs["varying"]["losses"], rtol=1e-4, atol=1e-4)
