"""The researchers' own encoder (their performer ``Transformer``, odissei-lifecourse/life-sequencing-dutch at 884ef02)
run on a packed model batch, without padding: :class:`PackedPerformer`.

    from lifeseq_shards.performer import PackedPerformer
    packed = PackedPerformer(model.transformer, pad_to=512)   # or pad_to=None
    hidden = packed(batch)          # (N, hidden): the batch's real tokens, in its token order

It holds their module, never a copy of its weights: every parameter and the FAVOR+ projections are read from it at
each call, so an optimizer step or a projection redraw through either is seen by both. Only their module's
structure is assumed (``embedding``, ``encoders[i].attention.attention`` of performer-pytorch's ``SelfAttention``,
the sublayer connections and the position-wise block); performer-pytorch and local-attention are not imported.

What runs per layer, as their padded forward computes it for a person's real tokens:

- their attention sublayer (ReZero) around this module's attention, then their position-wise one. Their
  multiplications by the padding mask (of the hidden state before each layer, of the global heads' values) zero only
  padding rows, and a packed batch has none: a static batch's filler persons attend only among themselves;
- the local heads: local-attention's bucketed window, buckets of ``window_size`` counted from each person's first
  token, a query of bucket b attending to the keys of buckets b - look_backward .. b + look_forward of the same
  person. Their padding keys are masked with -finfo.max, so they get exactly zero weight: the autopadded tail buckets
  and the padded length change nothing for a real token, and both modes compute the same local heads;
- the global heads: FAVOR+ (softmax kernel, non-causal) per person, as segment sums over the packed rows. Their
  padded model leaks padding into these heads: a padding key is exactly 0 (its hidden state is zeroed, no qkv bias),
  its value is zeroed, but its feature phi(0) = ratio * (exp(-stabiliser) + eps) stays in the denominator, and its
  0 in the key stabiliser's maximum. ``pad_to=L`` adds what the L - n padding keys of an n-token person add there,
  in closed form; ``pad_to=None`` adds nothing (the person alone, unpadded).

``pad_to=L`` reproduces their model padded to L, so a checkpoint trained padded keeps its meaning; ``pad_to=None``
is the attention without padding, for new training (an embedding at ``pad_to=None`` does not depend on any length).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .device.batch import StaticModelBatch
from .device.index import starts

FIRST_UNTIMED = 5  # their embeddings zero the age and abspos terms of each person's first 5 tokens
KERNEL_EPS = 1e-4  # performer-pytorch's softmax_kernel eps, added after the stabiliser
# the features' exponents are clamped here: exp(-30) + KERNEL_EPS is KERNEL_EPS in fp32 and bf16 (under half its ulp),
# so the features are the same bits, and the CPU's exp never takes its slow path for results that underflow (10-25x
# slower a value; most of the keys' values at their person's stabiliser: docs/results/performer.md)
MIN_EXPONENT = -30.0


class PackedLayout(NamedTuple):
    """Where a packed batch's N rows lie, built once per forward and shared by the layers. Buckets are their local
    windows, ``W`` of them of ``window`` cells: by default an upper bound fixed by N and B, so a static batch has one
    shape (the empty ones after every person's, held by an extra person ``B`` without keys); or exactly the buckets
    the persons fill, when the caller knows that count on the host."""

    keep_time: Tensor  # (N, 1) 0.0 on each person's first FIRST_UNTIMED tokens, else 1.0
    padding: Tensor  # (B + 1,) the padding keys each person's global heads count (pad_to - length, or 0; 0 for B)
    row_cell: Tensor  # (N,) each row's cell in the flattened (W * window) buckets
    cell_row: Tensor  # (W * window,) the row each cell holds (an empty cell: its bucket's first row; see cell_filled)
    cell_filled: Tensor  # (W * window,) whether a cell holds a row
    bucket_person: Tensor  # (W,) each bucket's person (B for an empty bucket, whose cells are all empty)
    person_buckets: Tensor  # (B + 1,) how many buckets each person fills (B: the empty ones), in bucket order
    key_cells: Tensor  # (W, K) the cells a bucket's queries read as keys: buckets b - back .. b + forward
    key_valid: Tensor  # (W, K) which of them are the same person's tokens


def bucket_count(cu_seqlens: Tensor, window: int) -> int:
    """The buckets of ``window`` cells the persons of ``cu_seqlens`` fill: reads the lengths back to the host."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return int((-(-counts // window)).sum())


def packed_layout(cu_seqlens: Tensor, n: int, window: int, back: int, forward: int, pad_to: int | None,
                  buckets: int | None = None) -> PackedLayout:
    """The :class:`PackedLayout` of ``n`` packed rows (``cu_seqlens`` (B+1,)) in ``buckets`` buckets (at least
    :func:`bucket_count`), or, by default, in the ceil(n / window) + B that hold any B persons of n rows. Gathers and
    scatters only: no host sync."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    b, dev = counts.shape[0], counts.device
    person = torch.repeat_interleave(torch.arange(b, device=dev), counts, output_size=n)
    pos = torch.arange(n, device=dev) - starts(counts)[person]
    n_buckets = -(-n // window) + b if buckets is None else buckets
    filled_buckets = -(-counts // window)
    person_buckets = torch.cat([filled_buckets, (n_buckets - filled_buckets.sum()).view(1)])
    bucket = starts(filled_buckets)[person] + torch.div(pos, window, rounding_mode="floor")
    row_cell = bucket * window + pos % window
    cell_row = torch.full((n_buckets * window,), n, dtype=torch.long, device=dev)
    cell_row.scatter_(0, row_cell, torch.arange(n, device=dev))
    cell_filled = cell_row < n
    # an empty cell holds its bucket's first row (its own person's, so that its FAVOR+ key, read but weighted 0,
    # stays under the person's stabiliser), or, in an empty bucket, the last row
    first = cell_row.view(n_buckets, window)[:, :1].expand(-1, window).reshape(-1)
    cell_row = torch.where(cell_filled, cell_row, first).clamp_(max=max(n - 1, 0))
    bucket_person = torch.repeat_interleave(torch.arange(b + 1, device=dev), person_buckets, output_size=n_buckets)
    index = torch.arange(n_buckets, device=dev)
    keys, valid = [], []
    for off in range(-back, forward + 1):
        j = index + off
        inside = (j >= 0) & (j < n_buckets)
        j = j.clamp(0, n_buckets - 1)
        same = inside & (bucket_person[j] == bucket_person)
        cells = j[:, None] * window + torch.arange(window, device=dev)
        keys.append(cells)
        valid.append(same[:, None] & cell_filled[cells])
    padding = torch.zeros_like(counts) if pad_to is None else pad_to - counts
    return PackedLayout((pos >= FIRST_UNTIMED).float()[:, None], F.pad(padding, (0, 1)).float(), row_cell, cell_row,
                        cell_filled, bucket_person, person_buckets, torch.cat(keys, 1), torch.cat(valid, 1))


class SegmentSum(torch.autograd.Function):
    """(W, ...) per bucket to (B + 1, ...) per person: each person's buckets summed in bucket order (a person's sums
    never see another's values), backward the gather back. ``index_add_``, its plain equivalent, takes 20x longer
    on the CPU of torch 2.13 (a scatter), and so does ``segment_reduce``'s own backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, person_buckets: Tensor, bucket_person: Tensor) -> Tensor:
        ctx.save_for_backward(bucket_person)
        return torch.segment_reduce(x, "sum", lengths=person_buckets, axis=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (bucket_person,) = ctx.saved_tensors
        return grad.index_select(0, bucket_person), None, None


class SegmentGather(torch.autograd.Function):
    """(B + 1, ...) per person to (W, ...) per bucket (each bucket its person's), backward :class:`SegmentSum`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, person_buckets: Tensor, bucket_person: Tensor) -> Tensor:
        ctx.save_for_backward(person_buckets)
        return x.index_select(0, bucket_person)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (person_buckets,) = ctx.saved_tensors
        return torch.segment_reduce(grad.contiguous(), "sum", lengths=person_buckets, axis=0), None, None


def local_heads(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, scale: float, dropout: nn.Module) -> Tensor:
    """local-attention's non-causal bucketed window on (W, window, heads, d) bucket cells (each person's buckets from
    its first token), to the same layout; ``dropout``: their module's, on the attention weights."""
    qb = (q * scale).transpose(1, 2)  # (W, h, window, d)
    kb, vb = (t.flatten(0, 1)[layout.key_cells].transpose(1, 2) for t in (k, v))  # (W, h, K, d)
    sim = qb @ kb.transpose(-1, -2)
    sim = sim.masked_fill(~layout.key_valid[:, None, None, :], -torch.finfo(sim.dtype).max)
    return (dropout(sim.softmax(dim=-1)) @ vb).transpose(1, 2)


def feature_logits(x: Tensor, projection: Tensor) -> tuple[Tensor, Tensor]:
    """performer-pytorch's softmax kernel before its exponential: the projections of ``x`` (..., d) scaled by d^-1/4,
    and half the scaled squared norm (..., 1)."""
    normalizer = x.shape[-1] ** -0.25
    dash = (normalizer * x) @ projection.type_as(x).t()
    return dash, (x**2).sum(-1, keepdim=True) * (normalizer**2 / 2.0)


def global_heads(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, projection: Tensor) -> Tensor:
    """FAVOR+ (softmax kernel, non-causal) of each person on (W, window, heads, d) bucket cells, to the same layout,
    with ``layout.padding`` padding keys (exactly 0: feature phi(0), value 0) counted per person as their padded
    model counts them. Per bucket first, then summed over each person's buckets: nothing of the features' width is
    gathered. The features are laid out (W, heads, window, features), so that no product copies them; performer's
    factor features^-1/2 scales every feature, so numerator and denominator alike, and is left out."""
    w, s = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (W, h, window, d)
    filled = layout.cell_filled.view(w, 1, s, 1)
    dash_q, diag_q = feature_logits(q, projection)
    qf = torch.exp((dash_q - (diag_q + dash_q.detach().amax(-1, keepdim=True))).clamp(min=MIN_EXPONENT)) + KERNEL_EPS
    dash_k, diag_k = feature_logits(k, projection)
    # the key stabiliser: the maximum over the person's keys and features, a padding key's projections (0) included
    bucket_max = dash_k.detach().amax(-1).masked_fill(~filled[..., 0], -torch.inf).amax(-1)  # (W, h)
    stab = bucket_max.new_zeros(layout.padding.shape[0], bucket_max.shape[1]).scatter_reduce(
        0, layout.bucket_person[:, None].expand_as(bucket_max), bucket_max, "amax", include_self=False)
    stab = stab.nan_to_num(neginf=0.0)  # a person without tokens (its empty buckets' -inf): no key to stabilise
    stab = torch.where(layout.padding[:, None] > 0, stab.clamp(min=0.0), stab)
    exponent = (dash_k - (diag_k + stab[layout.bucket_person][:, :, None, None])).clamp(min=MIN_EXPONENT)
    kf = torch.exp(exponent) + KERNEL_EPS
    # the values beside a 1 (the denominator's key sum), 0 in an empty cell: an empty cell is no key
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], -1) * filled
    per_person = SegmentSum.apply(kf.transpose(-1, -2) @ v1, layout.person_buckets, layout.bucket_person)
    padding_keys = layout.padding[:, None] * (torch.exp(-stab) + KERNEL_EPS)  # (B + 1, h)
    per_person = torch.cat([per_person[..., :-1], per_person[..., -1:] + padding_keys[:, :, None, None]], -1)
    out = qf @ SegmentGather.apply(per_person, layout.person_buckets, layout.bucket_person)  # (W, h, window, e + 1)
    # an empty cell's person may hold no key (a denominator of 0); its output is never read, but 0/0 would put a NaN
    # into the backward
    return (out[..., :-1] / (out[..., -1:] + ~filled)).transpose(1, 2)


class PackedPerformer(nn.Module):
    """Their ``Transformer`` (the encoder inside their ``TransformerEncoder``: ``model.transformer``) on packed model
    batches (``layout="packed"``, a token budget's static batches included).

    Args:
        encoder: their module; held, not copied (its parameters are this module's, so ``.parameters()``, an
            optimizer and a checkpoint of either see the same tensors).
        pad_to: ``L`` to behave as their model with every person padded to L (their ``max_length``; its global heads
            count each person's L - n padding keys: existing checkpoints keep their meaning); ``None`` for no padding
            keys (each person as their model computes it alone, unpadded: the attention to train new models with).
        static: ``True`` lays out a batch of N rows and B persons in the same ceil(N / 38) + B buckets of their
            window whoever the persons are, without a pull to the host (one shape for a compiled step or a CUDA
            graph); ``False`` reads the batch's lengths back to the host once a forward and lays out only the buckets
            its persons fill (fewer cells: faster in eager mode, on the CPU or wherever a sync per batch is cheap).
            A ``StaticModelBatch`` (a front end's static shape) is always laid out the first way.
    """

    def __init__(self, encoder: nn.Module, pad_to: int | None, static: bool = True) -> None:
        super().__init__()
        if pad_to is not None and pad_to < 1:
            raise ValueError(f"PackedPerformer(pad_to={pad_to}): a padded length >= 1, or None for no padding keys")
        self.encoder = encoder
        self.pad_to = pad_to
        self.static = static

    def extra_repr(self) -> str:
        return f"pad_to={self.pad_to}, static={self.static}"

    @property
    def padding(self) -> str:
        """The mode as an embedding file records it (``EmbeddingWriter(padding=...)``): ``"packed pad_to=L"`` or
        ``"packed unpadded"``."""
        return "packed unpadded" if self.pad_to is None else f"packed pad_to={self.pad_to}"

    def forward(self, batch: Any) -> Tensor:
        """(N, hidden) states of the batch's N token rows (``input_ids`` (4, N): token, abspos, age, segment;
        ``cu_seqlens`` and the host int ``max_len``)."""
        ids = batch["input_ids"]
        max_len = int(batch["max_len"])
        if self.pad_to is not None and max_len > self.pad_to:
            raise ValueError(f"PackedPerformer(pad_to={self.pad_to}) got a batch of persons up to max_len={max_len} "
                             f"tokens: build the batches with pad_to={self.pad_to} (their max_length), or use "
                             "pad_to=None")
        local = self.encoder.encoders[0].attention.attention.local_attn
        cu = batch["cu_seqlens"]
        exact = not (self.static or isinstance(batch, StaticModelBatch))
        layout = packed_layout(cu, ids.shape[1], local.window_size, local.look_backward, local.look_forward,
                               self.pad_to, bucket_count(cu, local.window_size) if exact else None)
        x = self.embed(ids, layout)
        for layer in self.encoder.encoders:
            x = layer.attention_sublayer(x, sublayer=lambda h, a=layer.attention.attention: self.attend(a, h, layout))
            x = layer.position_sublayer(x, sublayer=layer.position_wise)
        return x

    def embed(self, ids: Tensor, layout: PackedLayout) -> Tensor:
        """Their embeddings on (4, N) packed ids: token, then ReZero'd age and abspos (each person's first tokens'
        zeroed) and segment."""
        emb = self.encoder.embedding
        tokens, abspos, age, segment = ids.unbind(0)
        x = emb.token(tokens)
        x = emb.res_age(x, emb.age(age.float()[:, None]) * layout.keep_time)
        x = emb.res_abs(x, emb.abspos(abspos.float()[:, None]) * layout.keep_time)
        x = emb.res_seg(x, emb.segment(segment))
        return emb.dropout(x)

    @staticmethod
    def attend(attention: nn.Module, x: Tensor, layout: PackedLayout) -> Tensor:
        """Their ``CustomSelfAttention`` on (N, hidden) rows: its global heads first, then its local ones."""
        heads, gh = attention.heads, attention.global_heads
        n_buckets = layout.key_cells.shape[0]
        # (W, window, heads, d): each person's rows in its buckets of the local window, where both kinds of head work;
        # the three projections as one, so that one gather lays them out
        to_qkv = (attention.to_q, attention.to_k, attention.to_v)
        bias = None if attention.to_q.bias is None else torch.cat([f.bias for f in to_qkv])
        qkv = F.linear(x, torch.cat([f.weight for f in to_qkv]), bias)[layout.cell_row]
        q, k, v = qkv.unflatten(0, (n_buckets, -1)).unflatten(-1, (3, heads, -1)).unbind(2)
        outs = []
        if gh:
            outs.append(global_heads(q[:, :, :gh], k[:, :, :gh], v[:, :, :gh], layout,
                                     attention.fast_attention.projection_matrix))
        if gh < heads:
            local = attention.local_attn
            scale = local.scale if local.scale is not None else q.shape[-1] ** -0.5
            outs.append(local_heads(q[:, :, gh:], k[:, :, gh:], v[:, :, gh:], layout, scale, local.dropout))
        out = torch.cat(outs, 2).flatten(0, 1)[layout.row_cell]
        return attention.dropout(attention.to_out(out.flatten(1)))


__all__ = ["PackedLayout", "PackedPerformer", "bucket_count", "packed_layout"]
