"""The encoder's padding-free path: on the packed layout it computes what the padded model computes for the same
persons (forward and gradients), whichever attention implementation runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lifeseq_shards import encoder as encoder_mod
from lifeseq_shards.device.batch import PackedModelBatch, PaddedModelBatch
from lifeseq_shards.device.build import count_tokens, host_sync_guard, model_batch, to_device
from lifeseq_shards.encoder import EncoderConfig, LifeSeqEncoder, Packed, varlen_attention
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import model_inputs, pretrain_losses
from lifeseq_shards.reader import ShardedDataset

VOCAB = 40


def _padded_and_packed(b: int = 5, n: int = 16, t: int = 4, seed: int = 0
                       ) -> tuple[PaddedModelBatch, PackedModelBatch]:
    """One padded batch (persons of different lengths, padding zeros) and the same persons packed, built
    independently of lifeseq_shards.device.build (plain loops)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([n, 3, 11, 1, 7][:b])
    real = (torch.arange(n) < lengths[:, None]).long()
    ids = torch.stack([
        torch.randint(5, VOCAB, (b, n), generator=g), torch.randint(0, 16000, (b, n), generator=g),
        torch.randint(0, 90, (b, n), generator=g), torch.randint(1, 3, (b, n), generator=g),
    ], 1) * real[:, None]
    pos = torch.stack([torch.randint(0, int(m), (t,), generator=g) for m in lengths])
    tokens = ids[:, 0].gather(1, pos)
    tokens[3, 1:] = 0  # unused slots (token 0): ignored by the loss in both layouts
    padded = PaddedModelBatch({"input_ids": ids, "padding_mask": real, "target_pos": pos, "target_tokens": tokens,
                               "target_cls": torch.randint(0, 3, (b,), generator=g)})
    starts = torch.cumsum(lengths, 0) - lengths
    packed = PackedModelBatch({"input_ids": torch.cat([ids[i, :, :m] for i, m in enumerate(lengths.tolist())], 1),
                               "cu_seqlens": F.pad(torch.cumsum(lengths, 0), (1, 0)).int(), "max_len": n,
                               "target_index": starts[:, None] + pos, "target_tokens": tokens,
                               "target_cls": padded["target_cls"]})
    return padded, packed


def _losses_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    mlm, cls = pretrain_losses(model, batch)
    (mlm + cls).backward()
    return torch.stack([mlm, cls]).detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("heads", [1, 4])
def test_varlen_forward_and_gradients_equal_the_padded_models(heads: int) -> None:
    torch.manual_seed(0)
    model = LifeSeqEncoder(EncoderConfig(32, 48, 2, heads), VOCAB, dropout=0.0)
    padded, packed = _padded_and_packed()
    x_pad = model.encode(padded["input_ids"], padded["padding_mask"])
    x_packed = model.encode(packed["input_ids"], Packed(packed["cu_seqlens"], packed["max_len"]))
    real = padded["padding_mask"].bool()
    torch.testing.assert_close(x_packed, x_pad[real], rtol=1e-5, atol=1e-5)  # every real token, person by person
    loss_pad, grads_pad = _losses_and_grads(model, padded)
    loss_packed, grads_packed = _losses_and_grads(model, packed)
    torch.testing.assert_close(loss_packed, loss_pad, rtol=1e-6, atol=1e-6)
    assert grads_pad.keys() == grads_packed.keys()
    for k in grads_pad:
        torch.testing.assert_close(grads_packed[k], grads_pad[k], rtol=1e-4, atol=1e-6, msg=k)


def test_padded_index_is_built_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer attends over the same persons: the fallback's padded index is built once per forward, not once
    per layer, and it is the device's packing (the same slots as model_batch's packed layout)."""
    torch.manual_seed(0)
    model = LifeSeqEncoder(EncoderConfig(32, 48, 3, 4), VOCAB, dropout=0.0)
    padded, packed = _padded_and_packed()
    calls = []
    built = encoder_mod.padded_index
    monkeypatch.setattr(encoder_mod, "padded_index", lambda *a: calls.append(a) or built(*a))
    layout = Packed(packed["cu_seqlens"], packed["max_len"])
    x_packed = model.encode(packed["input_ids"], layout)
    assert len(calls) == 1
    torch.testing.assert_close(x_packed, model.encode(padded["input_ids"], padded["padding_mask"])[
        padded["padding_mask"].bool()], rtol=1e-5, atol=1e-5)
    index = built(layout, int(packed["cu_seqlens"][-1]))
    real = padded["padding_mask"].bool()
    assert torch.equal(index.real, real)
    assert torch.equal(index.cells, real.flatten().nonzero()[:, 0])  # row i of the packed array: the i-th real cell


def test_packed_encoder_traces_as_one_graph() -> None:
    """The index shared by the layers (a Python object built during the forward) does not break torch.compile's
    graph: dynamo traces the packed encoder whole (backend "eager": the trace only, no code generation)."""
    torch.manual_seed(0)
    model = LifeSeqEncoder(EncoderConfig(32, 48, 2, 4), VOCAB, dropout=0.0)
    _, packed = _padded_and_packed()
    layout = Packed(packed["cu_seqlens"], packed["max_len"])
    compiled = torch.compile(model.encode, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(packed["input_ids"], layout), model.encode(packed["input_ids"], layout))


def _reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k):
    """A stand-in for FlashAttention's varlen kernel, person by person, with its default scale 1/sqrt(head dim)."""
    assert q.shape[-1] % 8 == 0 and max_q == max_k
    bounds = cu_q.tolist()
    out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
           for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(out)


@pytest.mark.parametrize("head_dim", [6, 8, 50])
def test_flash_path_pads_head_dims_and_keeps_the_scale(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's own code (head dims padded to a multiple of 8, q rescaled) run on CPU against a stand-in
    kernel: the same attention as the fallback's padded SDPA."""
    lengths = torch.tensor([5, 1, 9])
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0)).int()
    q, k, v = torch.randn(3, int(lengths.sum()), 2, head_dim, generator=torch.Generator().manual_seed(1))
    packed = Packed(cu, 12)
    want = varlen_attention(q, k, v, packed)
    monkeypatch.setattr(encoder_mod, "_VARLEN_ATTN", _reference_kernel)
    monkeypatch.setattr(encoder_mod, "varlen_backend", lambda _q: "flash-varlen")
    got = varlen_attention(q, k, v, packed)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_backend_choice_is_explicit() -> None:
    q = torch.zeros(4, 2, 64)
    assert encoder_mod.varlen_backend(q) == "padded-sdpa"  # CPU
    assert encoder_mod.varlen_backend(q.bfloat16()) == "padded-sdpa"


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [3, 10, 5])  # head dims 64 (small-tc), 16 (small), 6 (padded to 8)
def test_cuda_flash_varlen_equals_the_padded_model_in_bf16(heads: int) -> None:
    torch.manual_seed(0)
    model = LifeSeqEncoder(EncoderConfig(30 if heads == 5 else 192 if heads == 3 else 160, 96, 2, heads), VOCAB,
                           dropout=0.0).cuda()
    padded, packed = (({k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.items()})
                      for b in _padded_and_packed())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x_pad = model.encode(padded["input_ids"], padded["padding_mask"])
        x_packed = model.encode(packed["input_ids"], Packed(packed["cu_seqlens"], packed["max_len"]))
        q = torch.zeros(2, 2, 64, device="cuda", dtype=torch.bfloat16)
        assert encoder_mod.varlen_backend(q) == ("flash-varlen" if encoder_mod._VARLEN_ATTN else "padded-sdpa")
        loss_pad, grads_pad = _losses_and_grads(model, padded)
        loss_packed, grads_packed = _losses_and_grads(model, packed)
    real = padded["padding_mask"].bool()
    torch.testing.assert_close(x_packed.float(), x_pad[real].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss_packed, loss_pad, rtol=1e-2, atol=1e-2)
    for k in grads_pad:  # bf16: relative to the gradient's size
        assert (grads_packed[k] - grads_pad[k]).norm() <= 5e-2 * grads_pad[k].norm() + 1e-6, k


@pytest.mark.cuda
def test_cuda_packed_step_never_syncs(nomlm_dataset: Path) -> None:
    """The padding-free step on CUDA, from the copied packed batch to the gradients: no host sync anywhere (CUDA's
    sync debug mode "error" and the Python-level pulls, device.host_sync_guard). Only the host-side plan (the token
    count, read from the pinned buffer before the copy) runs outside the guard."""
    host = next(iter(ShardedDataset(nomlm_dataset, split="train", batch_size=64, seed=0, packed=True)))
    counted = count_tokens(host.with_buffer(torch.from_numpy(host.buffer)).pin_memory(), 128)
    model = LifeSeqEncoder(EncoderConfig(64, 128, 2, 4), 2970, dropout=0.1).cuda()
    masker = DynamicMasker(MaskingConfig(vocab_size=2970))
    with host_sync_guard(), torch.autocast("cuda", dtype=torch.bfloat16):
        batch = model_batch(to_device(counted, "cuda"), masker, epoch=0, layout="packed", max_len=128)
        mlm, cls = pretrain_losses(model, batch)
        (mlm + cls).backward()
    assert torch.isfinite(mlm + cls)


def test_a_batch_without_mlm_targets_has_a_zero_mlm_loss() -> None:
    """A batch whose persons have no MLM target (persons of 1-3 tokens, ratio=0, a CLS-only run): the MLM loss is 0
    and adds no gradient, in both layouts, where a mean over zero targets was NaN and turned every weight NaN at the
    optimizer step. With targets, it is still their mean."""
    torch.manual_seed(0)
    model = LifeSeqEncoder(EncoderConfig(32, 48, 2, 4), VOCAB, dropout=0.0)
    padded, packed = (b.replace(target_tokens=torch.zeros_like(b["target_tokens"]))  # every slot unused
                      for b in _padded_and_packed())
    loss_pad, grads_pad = _losses_and_grads(model, padded)
    loss_packed, grads_packed = _losses_and_grads(model, packed)
    assert loss_pad[0] == loss_packed[0] == 0 and torch.isfinite(loss_pad).all()
    for k in grads_pad:
        assert torch.isfinite(grads_pad[k]).all() and torch.isfinite(grads_packed[k]).all(), k
        torch.testing.assert_close(grads_packed[k], grads_pad[k], rtol=1e-4, atol=1e-6, msg=k)
    padded, _ = _padded_and_packed()
    mlm, _ = model(*model_inputs(padded))
    used = padded["target_tokens"] != 0
    want = F.cross_entropy(mlm[used].float(), padded["target_tokens"][used])
    torch.testing.assert_close(pretrain_losses(model, padded)[0], want, rtol=1e-6, atol=1e-6)
