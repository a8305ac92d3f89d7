"""The researchers' performer encoder (their ``Transformer``, odissei-lifecourse/life-sequencing-dutch at 884ef02)
rebuilt on their dependencies, performer-pytorch 1.1.4's ``SelfAttention`` with local-attention 1.9.14's window,
with their edits, from reading their code (none of it copied): the reference of tests/test_performer.py and of
tools/bench_performer.py where their repository is not at hand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from performer_pytorch import SelfAttention
from torch import Tensor, nn


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


# base: their D3-hparams-large.txt's BERT-base dims (12 heads) with the small file's attention settings, as
# tools/seed_bench.py's base
SIZES = {"small": TheirSize(160, 1240, 3, 3000), "medium": TheirSize(280, 2210, 5, 3000),
         "base": TheirSize(768, 3072, 12, 3000, heads=12), "tiny": TheirSize(40, 64, 2, 50, features=48)}


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
