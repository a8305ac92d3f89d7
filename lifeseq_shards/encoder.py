"""The reference BERT-style encoder: its sizes (:data:`SIZES`), embeddings, pre-norm layers, MLM and CLS heads, on
either layout of the model's batch. The Lightning steps that pre-train it are :mod:`lifeseq_shards.model`'s.

Its shape and cost match the researchers' model (same hidden/ff/layers/heads sizes, token + segment + time
embeddings, pre-norm layers, an MLM head on the masked positions and a 3-class sequence-order head on [CLS]), but it
is not their code.

Two layouts, one set of weights: the padded batch ((B, 4, L) ``input_ids`` + ``padding_mask``), and the packed
one (``lifeseq_shards.device.build.model_batch(layout="packed")``: (4, N) ``input_ids`` of the N real tokens,
``cu_seqlens`` and a host-side ``max_len``). On the packed layout every layer but attention works on (N, hidden) rows,
so no FLOP is spent on padding; attention runs per person (:func:`varlen_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import compat
from .device.index import packed_cells, padded_rows
from .store.format import PAD

N_CLS_CLASSES = 3  # target_cls: 0 original order, 1 events reversed, 2 events shuffled
N_SEGMENTS = 3  # 0 = padding / background prefix, 1 = same day as the previous event, 2 = a later day
INIT_STD = 0.02  # BERT's weight initialisation (see _init_weights)


@dataclass(frozen=True)
class EncoderConfig:
    hidden: int
    ff: int
    layers: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# A module's hparams may hold one: allowed in torch.load's weights_only mode, which Lightning uses to load checkpoints
compat.add_safe_globals([EncoderConfig])


# The seed's sizes, and the same rounded for tensor cores: hidden = the next multiple of 64, heads of 64 (the
# head dims 16 / 28 / 50 of the originals are below FlashAttention's smallest tile of 32 or not a multiple of 8),
# and ff = the multiple of 64 that keeps the per-layer weight count closest to the original's (within 2%;
# tests/tools/test_train_bench.py checks it), so a "-tc" model costs the same FLOPs and differs only in shape.
SIZES: dict[str, EncoderConfig] = {
    "small": EncoderConfig(160, 1240, 3, 10),
    "medium": EncoderConfig(280, 2210, 5, 10),
    "large": EncoderConfig(500, 3940, 9, 10),
    "small-tc": EncoderConfig(192, 896, 3, 3),
    "medium-tc": EncoderConfig(320, 1792, 5, 5),
    "large-tc": EncoderConfig(512, 3776, 9, 8),
    # The researchers' BERT-base-sized model (D3-hparams-large.txt: 768/3072/12/12, max_length 1024). Its heads are
    # 64 wide and hidden and ff multiples of 64 already, as tensor cores and FlashAttention want: no "-tc" twin.
    "base": EncoderConfig(768, 3072, 12, 12),
}


def resolve_size(size: str | EncoderConfig) -> EncoderConfig:
    """``size``: a name of :data:`SIZES`, or an :class:`EncoderConfig`, returned as it is."""
    return size if isinstance(size, EncoderConfig) else SIZES[size]


def model_flops_per_token(
    cfg: EncoderConfig, seq_len: float, vocab_size: int = 0, target_fraction: float = 0.0
) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token, the usual 6*N + attention estimate.

    N counts the matmul weights of the layers (embedding lookups are not matmuls); attention adds QK^T and PV,
    2 * 2 * seq_len * hidden per layer forward. The MLM decoder runs only on the masked share of the tokens
    (`target_fraction`, targets / tokens), so its h x vocab matmul is counted at that share. ``cfg``: the
    encoder's sizes; ``vocab_size``: the decoder's output width (its h x vocab matmul).
    """
    h, layers = cfg.hidden, cfg.layers
    layer_weights = 4 * h * h + 2 * h * cfg.ff
    per_token = 6 * layers * layer_weights + 6 * layers * 2 * seq_len * h
    per_token += 6 * target_fraction * (h * h + h * vocab_size)
    return float(per_token)


def sinusoid(x: Tensor, dim: int, max_period: float) -> Tensor:
    """Fixed sin/cos features of a scalar (days or years), periods geometric from 1 to `max_period`."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = x.float().unsqueeze(-1) * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Embeddings(nn.Module):
    """token + segment embeddings + a learned projection of sinusoidal abspos (days) and age (years) features."""

    def __init__(self, cfg: EncoderConfig, vocab_size: int, dropout: float) -> None:
        super().__init__()
        self.hidden = cfg.hidden
        self.token = nn.Embedding(vocab_size, cfg.hidden, padding_idx=PAD)
        self.segment = nn.Embedding(N_SEGMENTS, cfg.hidden)
        self.time = nn.Linear(2 * cfg.hidden, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``input_ids`` (B, 4, L) padded or (4, N) packed: the four fields are axis -2 in both."""
        tokens, abspos, age, segment = input_ids.unbind(-2)
        # ~45 years of days and ~120 years of age: the longest period covers the whole range of each.
        time = torch.cat([sinusoid(abspos, self.hidden, 20_000.0), sinusoid(age, self.hidden, 150.0)], dim=-1)
        x = self.token(tokens) + self.segment(segment) + self.time(time.to(self.time.weight.dtype))
        return self.dropout(self.norm(x))


class Packed(NamedTuple):
    """Where each person's tokens lie in a packed (N, ...) array: ``cu_seqlens`` (B+1,) int32 offsets on the device,
    and ``max_len``, an upper bound of the lengths known on the host (the kernels size their grids from it, so
    reading it from the device would sync)."""

    cu_seqlens: Tensor
    max_len: int


_VARLEN_ATTN = compat.varlen_kernel()


def varlen_backend(q: Tensor) -> str:
    """Which implementation :func:`varlen_attention` uses for ``q`` (N, heads, head_dim), and why that one:

    - ``"flash-varlen"``: ``varlen_attn`` on CUDA in fp16/bf16 (its only dtypes), head dims up to 256 (non-multiples
      of 8 padded with zeros). No attention-probability dropout: the kernel has no such option.
    - ``"padded-sdpa"`` everywhere else (CPU, fp32, torch < 2.10): each person's rows padded to ``max_len`` around
      attention only, then scaled_dot_product_attention with a key mask; the same numbers as the padded model.
    """
    wanted = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    if wanted and _VARLEN_ATTN is None:
        compat.fallback("torch.nn.attention.varlen (FlashAttention's variable-length kernel, torch >= 2.10)",
                        "the padding-free step's attention pads each person around SDPA (padded-sdpa)")
    return "flash-varlen" if wanted and _VARLEN_ATTN is not None else "padded-sdpa"


class PaddedIndex(NamedTuple):
    """A packed batch's rows laid out padded, for attention on the ``"padded-sdpa"`` backend."""

    rows: Tensor  # (B, max_len) the packed row of each padded cell, clamped into range
    real: Tensor  # (B, max_len) the cells attention reads as keys: those holding a token (cell 0 of one without any)
    cells: Tensor  # (N,) each packed row's cell in the flattened (B * max_len) padded array


def padded_index(packed: Packed, n: int) -> PaddedIndex:
    """The :class:`PaddedIndex` of ``n`` packed rows (:mod:`lifeseq_shards.device.index`, as the device's packing)."""
    # not diff(): torch 2.1's dynamo cannot trace diff of a dynamic size (a recompile for another person count failed)
    counts = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).long()
    rows, real = padded_rows(counts, packed.max_len)
    # a person without tokens (a static batch's padding persons) attends to one key all the same: over no key at all,
    # SDPA's softmax is NaN before torch 2.5, and its backward carries the NaN into the rows the cells were read from
    real[:, 0] = True
    return PaddedIndex(rows.clamp_(max=max(n - 1, 0)), real, packed_cells(counts, packed.max_len, n))


class PackedPass:
    """A packed layout as the layers of one forward see it: the padded index depends on the batch only, so the
    first layer that needs it builds it and the others reuse it (the flash backend never does)."""

    def __init__(self, packed: Packed, n: int) -> None:
        self.packed, self.n = packed, n
        self._index: PaddedIndex | None = None

    def padded_index(self) -> PaddedIndex:
        if self._index is None:
            self._index = padded_index(self.packed, self.n)
        return self._index


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, packed: Packed | PackedPass, dropout_p: float = 0.0) -> Tensor:
    """Bidirectional attention of each person's tokens among themselves on (N, heads, head_dim) rows; see
    :func:`varlen_backend` for the implementation chosen. A :class:`PackedPass` shares its padded index across
    calls."""
    batch = packed if isinstance(packed, PackedPass) else PackedPass(packed, q.shape[0])
    if varlen_backend(q) == "flash-varlen":
        d = q.shape[-1]
        pad = -d % 8
        if pad:  # zero q/k columns add nothing to the scores; q rescaled so the kernel's 1/sqrt(d+pad) is 1/sqrt(d)
            q = F.pad(q * math.sqrt((d + pad) / d), (0, pad))
            k, v = F.pad(k, (0, pad)), F.pad(v, (0, pad))
        cu, max_len = batch.packed
        return _VARLEN_ATTN(q, k, v, cu, cu, max_len, max_len)[..., :d]
    index = batch.padded_index()
    # (B, heads, max_len, head_dim); a list, not a generator: torch 2.1's dynamo cannot unpack one in a graph
    qp, kp, vp = [t[index.rows].transpose(1, 2) for t in (q, k, v)]
    a = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=index.real[:, None, None, :], dropout_p=dropout_p)
    return a.transpose(1, 2).flatten(0, 1)[index.cells]


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer; attention through scaled_dot_product_attention so PyTorch picks the kernel, or
    per person on the packed layout."""

    def __init__(self, cfg: EncoderConfig, dropout: float) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.ff = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.ff), nn.GELU(), nn.Linear(cfg.ff, cfg.hidden), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor, attend: Tensor | Packed | PackedPass) -> Tensor:
        """``x`` (B, L, hidden) with ``attend`` (B,1,1,L) bool, True = a real key token; or (N, hidden) with
        :class:`Packed` (or the :class:`PackedPass` the encoder shares among its layers)."""
        h = x.shape[-1]
        p = self.dropout if self.training else 0.0
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, h // self.heads))
        if isinstance(attend, (Packed, PackedPass)):
            a = varlen_attention(*qkv.unbind(-3), attend, dropout_p=p).flatten(-2)
        else:
            b, n = x.shape[:2]
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p).transpose(1, 2).reshape(b, n, h)
        x = x + F.dropout(self.out(a), self.dropout, self.training)
        return x + self.ff(self.norm2(x))


class LifeSeqEncoder(nn.Module):
    """Embeddings, `layers` pre-norm layers, final norm; MLM decoder tied to the token embedding; CLS head.

    ``cfg``: the sizes (hidden, ff, layers, heads); ``vocab_size``: the token ids the embedding and the decoder
    cover (the manifest's); ``dropout``: after the embeddings and in every layer."""

    def __init__(self, cfg: EncoderConfig, vocab_size: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg, vocab_size, dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.mlm_transform = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(), nn.LayerNorm(cfg.hidden))
        self.mlm_bias = nn.Parameter(torch.zeros(vocab_size))
        self.cls_head = nn.Linear(cfg.hidden, N_CLS_CLASSES)
        self.apply(_init_weights)


    def encode(self, input_ids: Tensor, layout: Tensor | Packed) -> Tensor:
        """(B, L, hidden) from a padded batch (``layout`` = its padding_mask), (N, hidden) from a packed one."""
        if isinstance(layout, Packed):
            attend: Tensor | PackedPass = PackedPass(layout, input_ids.shape[-1])
        else:
            attend = layout.bool()[:, None, None, :]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, attend)
        return self.norm(x)

    def forward(self, input_ids: Tensor, layout: Tensor | Packed, targets: Tensor) -> tuple[Tensor, Tensor]:
        """MLM logits (B,T,vocab) at ``targets`` and CLS logits (B,3) from each person's first token. ``targets``:
        positions in each row (padded), or rows of the packed array (packed)."""
        x = self.encode(input_ids, layout)
        if isinstance(layout, Packed):
            # clamped: a static batch's last padding persons hold no token and start past the last row
            picked, first = x[targets], x[layout.cu_seqlens[:-1].long().clamp(max=x.shape[0] - 1)]
        else:
            picked, first = torch.gather(x, 1, targets.unsqueeze(-1).expand(-1, -1, x.shape[-1])), x[:, 0]
        mlm = self.mlm_transform(picked) @ self.embed.token.weight.t() + self.mlm_bias
        return mlm, self.cls_head(first)


def _init_weights(module: nn.Module) -> None:
    """BERT's initialisation: weights N(0, 0.02), biases 0 (LayerNorms keep 1 and 0). The MLM decoder is the token
    embedding transposed, so with PyTorch's default N(0, 1) embeddings the first logits had a spread of
    sqrt(hidden) and the first MLM loss was about 5x ln(vocab) (41 for ``small``); at 0.02 it starts near
    ln(vocab), a uniform guess."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        with torch.no_grad():
            module.weight[module.padding_idx].zero_()
