"""The seed's MLM rules (CLS permutation task, random-token or event masking), drawn on the device per step.

The seed drew masks once, offline, so every epoch saw the same masks. Here they are drawn per step, vectorised in
torch, from random numbers that are a pure function of ``(seed, epoch, person_id, counter, stream)``: a resumed or
re-sharded run masks a person identically whichever rank, worker, batch or padded length the person lands in, and the
same code gives the same bits on CPU and CUDA. No ``torch.Generator`` (it would need a Python loop over persons) and
no host sync: everything is a few elementwise kernels, a scatter, a cumsum, a sort and a searchsorted.

The hash works on 32-bit words held in int64 tensors, with every product split into 16-bit halves so no intermediate
ever exceeds 2**49: signed overflow (undefined in C++, whatever torch happens to do) and arithmetic right shifts of
negative numbers never occur. docs/reference/masking.md gives the rules and what was checked against the seed's
own files.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .cudagraph import GraphedFunction
from .store.format import MASK, SEP, SPECIAL_TOKENS, STAMPS, UNK

DEFAULT_RATIO = 0.30


class Offline(enum.Enum):
    """``masking=OFFLINE``: the masks stored in the dataset (converted from the seed's encoded_mlm.h5), bit for bit;
    the word ``"offline"`` says the same (``Offline.of``)."""

    OFFLINE = "offline"

    @classmethod
    def of(cls, masking: Any) -> Any:
        """:data:`OFFLINE` for it or for its word ``"offline"``; any other masking as it is."""
        return cls.OFFLINE if masking is cls.OFFLINE or masking == cls.OFFLINE.value else masking


OFFLINE = Offline.OFFLINE

# how a DynamicMasker launches its kernels: one by one, through torch.compile, or replayed as a CUDA graph
EAGER, COMPILED, GRAPHED = "eager", "compiled", "graphed"
LAUNCHES = (EAGER, COMPILED, GRAPHED)

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # added before each mix so that the all-zero input is not a fixed point

# One stream per independent decision, so that e.g. the shuffle order and the target choice never share bits.
_STREAM_CLS, _STREAM_SHUFFLE, _STREAM_SELECT, _STREAM_TOKEN, _STREAM_EVENT = 1, 2, 3, 4, 5


def _mul32(x, c: int):
    """``x * c mod 2**32`` for 0 <= x, c < 2**32 without any intermediate above 2**49 (tensor or int ``x``).

    ``c`` is split into 16-bit halves: ``x * c_lo`` and ``x_lo * c_hi * 2**16`` both stay below 2**48, and the rest
    of ``x * c_hi * 2**16`` is a multiple of 2**32. Five elementwise kernels: the hash is most of the masker's launches.
    """
    return (x * (c & 0xFFFF) + (x & 0xFFFF) * ((c >> 16) << 16)) & _M32


def _mix32(x):
    """A 32-bit bijective avalanche mixer (xorshift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h, w):
    """Fold the 32-bit word ``w`` into the state ``h``; a bijection in ``w`` for a fixed ``h``."""
    return _mix32(((h ^ w) + _GOLDEN) & _M32)


def _words(v):
    """The low and high 32-bit words of a 64-bit integer (two's complement for negatives; int or int64 tensor)."""
    return v & _M32, (v >> 32) & _M32


def person_keys(seed: int, epoch: int, streams: tuple[int, ...], person_id: torch.Tensor) -> torch.Tensor:
    """(S, B) 32-bit keys, one per stream and person (``person_id``, (B,)), for one (seed, epoch): the
    batch-independent part of every draw. All streams go through one set of kernels; only the first word differs per
    stream."""
    starts = []
    for stream in streams:
        h = 0
        for w in (*_words(seed), *_words(epoch), stream):
            h = _absorb(h, w)  # Python ints: computed on the host once, passed to the kernels as a scalar
        starts.append(h)
    low, high = _words(person_id.long())
    first = _mix32((torch.stack([low ^ h for h in starts]) + _GOLDEN) & _M32)  # _absorb(h, low), h per stream
    return _absorb(first, high)


def random_bits(keys: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """(..., n) uniform 32-bit integers for keys (...) and counters ``counter`` ((n,) or (..., n)), distinct across
    one key's counters."""
    return _absorb(keys[..., None], counter)


@dataclass(frozen=True, kw_only=True)
class MaskingConfig:
    """The seed's defaults; ``keep`` and ``mask`` are shares of the targets, the rest get a random token.

    ``kind``: ``"random"`` (single tokens) or ``"event"`` (whole events) as targets; ``ratio``: the targets' share of
    a person's tokens (at most ``floor(ratio * length)``); ``cls_task``: draw the CLS task first, the event groups
    reversed with probability ``p_reverse`` and shuffled with ``p_shuffle``; ``n_special``: the ids below it are
    special tokens, never targets or replacements (at least 5: [PAD] [CLS] [SEP] [MASK] [UNK]); ``seed``: with the
    epoch and the person id, what every draw depends on (docs/reference/masking.md gives each rule).

    ``vocab_size`` is the number of token ids (the largest id + 1; random replacements are drawn below it). Leave it
    unset with ``LifeSeqDataModule``, which fills it in from the dataset's manifest.
    """

    kind: str = "random"
    ratio: float = DEFAULT_RATIO
    cls_task: bool = True
    p_reverse: float = 0.05
    p_shuffle: float = 0.05
    keep: float = 0.1
    mask: float = 0.8
    vocab_size: int | None = None
    n_special: int = len(SPECIAL_TOKENS)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("random", "event"):
            raise ValueError(f"kind must be 'random' or 'event', not {self.kind!r}")
        for name in ("ratio", "p_reverse", "p_shuffle", "keep", "mask"):  # a NaN passes every comparison below
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)} is not a finite number")
        if self.n_special < UNK + 1:  # the ids below are fixed: [MASK]/[UNK] would be targets and replacements
            raise ValueError(f"n_special {self.n_special} is below {UNK + 1}: ids 0-{UNK} are "
                             f"{' '.join(SPECIAL_TOKENS)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio {self.ratio} is not in [0, 1]")
        if min(self.keep, self.mask, self.p_reverse, self.p_shuffle) < 0:
            raise ValueError("keep, mask, p_reverse and p_shuffle must be >= 0")
        if self.keep + self.mask > 1.0 or self.p_reverse + self.p_shuffle > 1.0:
            raise ValueError("keep + mask and p_reverse + p_shuffle must be <= 1")
        if self.vocab_size is not None and not self.n_special < self.vocab_size <= self.n_special + 2**31:
            raise ValueError(f"vocab_size {self.vocab_size} must exceed n_special {self.n_special} (and be < 2**31)")

    @property
    def random_share(self) -> float:
        # rounded so that 1 - 0.1 - 0.8 is 0.1, not 0.0999..., which would floor 10 targets to 0 random tokens
        return round(1.0 - self.keep - self.mask, 12)


def fill_targets(pos: torch.Tensor, tok: torch.Tensor, n: torch.Tensor, length: int, max_targets: int):
    """(B, max_targets) target_pos / target_tokens: the first ``n`` of ``pos``/``tok``, the rest position L-1 / token 0.

    The seed fills unused targets with position 511 and token 0 for L = 512; token 0 is the loss's ignore index. A
    target at or past ``length`` (outside the batch) becomes an unused target too; the reader never crops offline
    targets (it refuses a pad_to below a person's length for offline-mask data).
    """
    if pos.shape[1] < max_targets:
        pad = max_targets - pos.shape[1]
        pos, tok = torch.nn.functional.pad(pos, (0, pad)), torch.nn.functional.pad(tok, (0, pad))
    used = (torch.arange(max_targets, device=pos.device) < n[:, None]) & (pos[:, :max_targets] < length)
    return torch.where(used, pos[:, :max_targets], length - 1), torch.where(used, tok[:, :max_targets], 0)


def _groups(tokens: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group id per position (the number of [SEP]s strictly before it, so a [SEP] closes its own group: group 0 is
    ``[CLS] background [SEP]``, group k the k-th event) and the (B, L+1) per-group sums of ``weight``."""
    is_sep = (tokens == SEP).long()
    group = torch.cumsum(is_sep, 1) - is_sep
    size = torch.zeros(tokens.shape[0], tokens.shape[1] + 1, dtype=torch.long, device=tokens.device)
    return group, size.scatter_add_(1, group, weight.long())


def _sort_sizes(order: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the column indices that sort ``order`` (stable: ties keep column order) and ``size`` in that order:
    ``(sort(order, stable=True).indices, size.gather(1, indices))``, bit for bit, for ``order`` in [0, 2**33) and
    ``size`` in [0, width).

    The column and the size ride in the low bits of one sort key instead of being gathered after the sort: a cumsum
    follows, and inductor has failed to generate a split scan whose input is a gather (docs/results/reader.md); a
    sort's values are a plain load.
    """
    width = order.shape[1]
    bits = max(width - 1, 1).bit_length()
    if 33 + 2 * bits > 63:
        raise ValueError(f"{width} columns do not fit the combined sort key; at most {2**15}")
    low = (1 << bits) - 1
    col = torch.arange(width, device=order.device)
    keys = torch.sort((order << (2 * bits)) | (col << bits) | size, dim=1).values  # distinct keys: stable anyway
    return (keys >> bits) & low, keys & low


def _behind(candidate: torch.Tensor, key: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """A sort key: ``key`` (below 2**32) where ``candidate``, else ``column + 2**32``, behind every candidate in
    column order. The offset is the mask shifted, not a literal added to ``column``: compiled, an arange becomes an
    int32 index in Triton, which refuses a literal beside it that does not fit int32."""
    return torch.where(candidate, key, column) + ((~candidate).long() << 32)


def _floor_share(share: float, n: torch.Tensor) -> torch.Tensor:
    """``floor(share * n)`` exactly as Python computes ``int(share * n)`` (float64 product, then floor)."""
    return (n.double() * share).floor().long()


class DynamicMasker:
    """Per-step MLM masking with the seed's rules (``cfg``, a :class:`MaskingConfig` whose ``vocab_size`` is set);
    see the module docstring for the reproducibility contract.

    ``cfg``: the rules (its ``vocab_size`` set). ``launch``: how its kernels are launched, the same masks bit for bit
    each way; the two that launch fewer kernels, for a host-bound step (docs/results/training-gpu.md), are opt-in
    until a GPU run says they pay:

    - ``"eager"`` (:data:`EAGER`, the default): :meth:`draw` as it is, kernel by kernel.
    - ``"compiled"`` (:data:`COMPILED`) runs :meth:`draw` through ``torch.compile`` (inductor's default mode, shapes
      static), built on the first call: a few fused kernels. Each new (B, L) and each epoch (a Python int, so a
      constant of the graph) compiles once more, and past dynamo's recompile limit the masker runs eagerly.
      (Compiled and CUDA-graphed at once is torch.compile's mode='reduce-overhead'.)
    - ``"graphed"`` (:data:`GRAPHED`) replays the eager kernels as a CUDA graph
      (:class:`~lifeseq_shards.cudagraph.GraphedFunction`), captured once per (B, L) and epoch: one launch, no
      compiler. Eager off CUDA."""

    def __init__(self, cfg: MaskingConfig, launch: str = EAGER) -> None:
        if cfg.vocab_size is None:
            raise ValueError("MaskingConfig.vocab_size is unset: pass the number of token ids (LifeSeqDataModule "
                             "fills it in from the dataset's manifest)")
        if launch not in LAUNCHES:
            raise ValueError(f"launch must be one of {', '.join(map(repr, LAUNCHES))}, not {launch!r}")
        self.cfg, self.launch = cfg, launch
        self._run: Callable[..., dict[str, torch.Tensor]] | None = None  # built lazily: the masker pickles

    def __call__(self, *args: Any) -> dict[str, torch.Tensor]:
        if self._run is None:
            self._run = (torch.compile(self.draw, dynamic=False) if self.launch == COMPILED
                         else GraphedFunction(self.draw) if self.launch == GRAPHED else self.draw)
        return self._run(*args)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_run": None}  # compiled functions and CUDA graphs do not pickle: rebuilt on use

    def draw(
        self,
        tokens: torch.Tensor,
        abspos: torch.Tensor,
        age: torch.Tensor,
        segment: torch.Tensor,
        lengths: torch.Tensor,
        person_id: torch.Tensor,
        epoch: int,
    ) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        tokens, lengths = tokens.long(), lengths.long()
        stamps = [abspos.long(), age.long(), segment.long()]
        B, L = tokens.shape
        pos = torch.arange(L, device=tokens.device)
        real = pos < lengths[:, None]

        # Every draw's counter is a position (0..L), so all of them are one hash pass: stream i's bits are bits[i].
        # The random tokens' bits are drawn for every position and gathered at the chosen ones.
        streams = ((_STREAM_CLS, _STREAM_SHUFFLE) if cfg.cls_task else ()) + (
            (_STREAM_SELECT, _STREAM_TOKEN) if cfg.kind == "random" else (_STREAM_EVENT,))
        keys = person_keys(cfg.seed, epoch, streams, person_id)
        bits = random_bits(keys, torch.arange(L + 1, device=tokens.device))

        if cfg.cls_task:
            u = bits[0, :, 0].double()
            rev, shuf = cfg.p_reverse * 2.0**32, (cfg.p_reverse + cfg.p_shuffle) * 2.0**32
            target_cls = torch.where(u < rev, 1, torch.where(u < shuf, 2, 0))
            tokens, stamps = self._permute_events(target_cls, bits[1, :, 1:], tokens, stamps, real, pos)
        else:
            target_cls = torch.zeros(B, dtype=torch.long, device=tokens.device)

        candidate = real & (pos >= 1) & (tokens >= cfg.n_special)
        max_targets = math.floor(cfg.ratio * L)
        budget = _floor_share(cfg.ratio, lengths)
        if cfg.kind == "random":
            masked, tpos, n = self._random_targets(
                bits[-2, :, :L], bits[-1], tokens, candidate, budget, pos, max_targets)
        else:
            masked, tpos, n = self._event_targets(bits[-1], tokens, candidate, budget, pos, max_targets)
        target_pos, target_tokens = fill_targets(tpos, tokens.gather(1, tpos), n, L, max_targets)
        return {
            "masked_tokens": masked,
            "original": tokens,
            **dict(zip(STAMPS, stamps, strict=True)),
            "target_pos": target_pos,
            "target_tokens": target_tokens,
            "target_cls": target_cls,
        }

    @staticmethod
    def _permute_events(
        target_cls: torch.Tensor,
        shuffle_bits: torch.Tensor,
        tokens: torch.Tensor,
        stamps: list[torch.Tensor],
        real: torch.Tensor,
        pos: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Reverse (cls 1) or shuffle (cls 2) the event token groups; slot i keeps event i's time stamps.

        Group 0 is the prefix ``[CLS] background [SEP]`` and never moves; group k >= 1 is the k-th event with its
        closing [SEP]. A slot whose new event is longer than its old one repeats its last stamp (the seed's stamps are
        constant within an event, so this is the seed's "slot values repeated over the event now in it").
        """
        B, L = tokens.shape
        _, size = _groups(tokens, real)
        K = size.shape[1]
        start = torch.cumsum(size, 1) - size
        k = torch.arange(1, K, device=tokens.device)
        cls = target_cls[:, None]
        order = torch.where(cls == 1, K - k, torch.where(cls == 2, shuffle_bits, k))
        order = _behind(size[:, 1:] > 0, order, k)
        moved, moved_size = _sort_sizes(order, size[:, 1:])
        old_of_slot = torch.cat([torch.zeros_like(moved[:, :1]), moved + 1], 1)
        new_size = torch.cat([size[:, :1], moved_size], 1)
        new_end = torch.cat([size[:, :1], size[:, :1] + torch.cumsum(moved_size, 1)], 1)
        slot = torch.searchsorted(new_end, pos.expand(B, L).contiguous(), right=True).clamp_max(K - 1)
        offset = pos - (new_end - new_size).gather(1, slot)
        src_token = start.gather(1, old_of_slot.gather(1, slot)) + offset
        src_stamp = start.gather(1, slot) + torch.minimum(offset, size.gather(1, slot) - 1)
        src_token, src_stamp = torch.where(real, src_token, pos), torch.where(real, src_stamp, pos)
        return tokens.gather(1, src_token), [s.gather(1, src_stamp) for s in stamps]

    def _random_targets(self, bits, token_bits, tokens, candidate, budget, pos, max_targets):
        """floor(ratio*length) candidates in random order: first ``keep`` share kept, last share random, rest [MASK]."""
        cfg = self.cfg
        order = torch.sort(_behind(candidate, bits, pos), dim=1, stable=True).indices[:, :max_targets]
        n = torch.minimum(budget, candidate.sum(1))
        n_keep, n_random = _floor_share(cfg.keep, n)[:, None], _floor_share(cfg.random_share, n)[:, None]
        j = torch.arange(max_targets, device=tokens.device)
        original = tokens.gather(1, order)
        span = cfg.vocab_size - cfg.n_special
        replacement = cfg.n_special + ((token_bits.gather(1, order) * span) >> 32)
        value = torch.where(j < n_keep, original, torch.where(j >= n[:, None] - n_random, replacement, MASK))
        value = torch.where(j < n[:, None], value, original)  # the positions beyond n are distinct: no-op writes
        return tokens.scatter(1, order, value), order, n

    def _event_targets(self, bits, tokens, candidate, budget, pos, max_targets):
        """Whole segments ([SEP]-delimited, background included) in random order while their total stays <= budget."""
        B, L = tokens.shape
        segment, size = _groups(tokens, candidate)
        K = size.shape[1]
        k = torch.arange(K, device=tokens.device)
        order, size_in_order = _sort_sizes(_behind(size > 0, bits, k), size)
        taken_in_order = (torch.cumsum(size_in_order, 1) <= budget[:, None]) & (size_in_order > 0)
        taken = torch.zeros_like(taken_in_order).scatter_(1, order, taken_in_order)
        rank = torch.empty_like(order).scatter_(1, order, k.expand(B, K).contiguous())
        target = candidate & taken.gather(1, segment)
        sort_key = _behind(target, rank.gather(1, segment) * L + pos, pos)
        tpos = torch.sort(sort_key, dim=1, stable=True).indices[:, :max_targets]
        return torch.where(target, MASK, tokens), tpos, target.sum(1)
