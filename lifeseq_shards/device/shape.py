"""The model batch's shape as values: its layout (:data:`PADDED` or :data:`PACKED`), where a front end's batches are
padded and cropped (:class:`Padding`), and the one shape of every packed batch of a token-budget run
(:class:`StaticShape`). :mod:`.build` builds batches to them; the front ends resolve them once."""

from __future__ import annotations

from dataclasses import dataclass

# the model batch's two layouts (the front ends' ``layout`` argument): the seed's padded (B, L), or the real tokens only
PADDED, PACKED = "padded", "packed"


@dataclass(frozen=True)
class StaticShape:
    """The one shape of every packed model batch of a token-budget run, so that a compiled step compiles once and a
    CUDA graph can be captured: ``tokens`` token positions (at least the budget: the real tokens a batch may hold)
    and room for ``persons`` real persons (``lifeseq_shards.plan.balance.person_rows`` of the split's lengths and
    the budget).

    A batch is padded after its real persons and tokens: the padding tokens ([PAD], abspos, age and segment 0) are
    dealt to padding persons of at most the padded width each, after which the remaining padding persons hold no
    token (``cu_seqlens`` repeats). Every token position belongs to a person because both attention backends need
    it: FlashAttention's varlen kernel never writes the rows past the last person (whatever the memory held would
    reach the next layer, and a NaN there the weights' gradients), and the padded fallback maps each row to a
    person's slot. A padding person attends only among its own padding tokens, so the real persons' outputs are
    those of the unpadded batch; it has ``lengths`` 0, no MLM target and ``target_cls`` :data:`NO_CLS`, so the
    losses count only the real persons and their targets.

    Args:
        tokens: the token positions of every batch (>= the most real tokens one holds).
        persons: the most real persons a batch holds (>= 1, <= ``tokens``).
    """

    tokens: int
    persons: int

    def __post_init__(self) -> None:
        if not 1 <= self.persons <= self.tokens:
            raise ValueError(f"StaticShape(tokens={self.tokens}, persons={self.persons}): persons must be between 1 "
                             "and tokens (every person holds a token)")

    def rows(self, width: int) -> int:
        """The person rows of a batch padded to this shape at padded width ``width``: room for :attr:`persons` real
        ones and for the padding persons that hold the rest of the tokens, ``width`` at most each. (b real persons
        hold at least b tokens, so the rows they need, b + ceil((tokens - b) / width), are most at b = persons.)"""
        return self.persons + -(-(self.tokens - self.persons) // width)


@dataclass(frozen=True)
class Padding:
    """Where a front end's batches are padded and cropped, derived here only from its ``layout`` (the model batch's,
    :data:`PADDED` or :data:`PACKED`), ``pad_to`` and ``static``. The host pads (and crops) to ``pad_to`` for a padded
    model batch with a ``pad_to``; otherwise it sends packed host batches (real tokens only), which the device pads to
    each batch's longest or, for a packed model batch, crops to ``pad_to`` (:attr:`max_len`).

    ``static``: a :class:`StaticShape` every packed training batch is padded to (token-budget batches); it needs
    ``layout="packed"`` and a ``pad_to``, the padded width, which must be a constant of the step too."""

    layout: str = PADDED
    pad_to: int | None = None
    static: StaticShape | None = None

    def __post_init__(self) -> None:
        if self.layout not in (PADDED, PACKED):
            raise ValueError(f"layout must be {PADDED!r} or {PACKED!r}, not {self.layout!r}")
        check_static(self.static, self.layout, self.max_len)

    @property
    def host_pad_to(self) -> int | None:
        """The width the host pads and crops each batch to (``ShardedDataset(pad_to=...)``); None: the device pads."""
        return None if self.layout == PACKED else self.pad_to

    @property
    def host_packed(self) -> bool:
        """Whether the host sends packed batches (``ShardedDataset(packed=True)``): whenever it does not pad."""
        return self.host_pad_to is None

    @property
    def max_len(self) -> int | None:
        """The device's crop (a packed model batch's ``pad_to``), None when it keeps every token the host sent."""
        return self.pad_to if self.layout == PACKED else None


def check_static(static: StaticShape | None, layout: str, max_len: int | None) -> None:
    """A static shape is for the packed layout at a fixed width (the padded intermediate and the attention's
    ``max_len`` are shapes of the step too)."""
    if static is None:
        return
    if layout != PACKED:
        raise ValueError(f"a static shape pads packed model batches, not layout={layout!r}: use layout={PACKED!r}")
    if max_len is None:
        raise ValueError("a static shape needs a fixed width, and max_len (the front ends' pad_to) is None: set it to "
                         "the longest person (or the crop)")
