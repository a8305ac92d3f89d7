"""What an embedding output directory holds (:class:`EmbeddingSpec`, its ``_embeddings.json``), and the error of a
directory or batch that does not match it. Both the directory (:mod:`.store`) and the files' stamps (:mod:`.stamp`)
are checked against it, so it sits below both. No torch here."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import pyarrow as pa

OUT_FORMAT = 1
ID_COLUMN = "person_id"


class EmbeddingsError(ValueError):
    """An output directory that is not the one asked for, or a batch that does not fit it; one line naming it."""


_PADDING = re.compile(r"(padded|packed)(?: pad_to=([1-9][0-9]*)| (unpadded))?")


@dataclass(frozen=True, repr=False)
class Padding:
    """How the model saw each person when it embedded it, written as text: ``"padded pad_to=512"`` (every person
    padded to 512), ``"packed pad_to=512"`` (only its real tokens, as if padded to 512:
    ``PackedPerformer(encoder, pad_to=512)``), ``"packed unpadded"`` (no padding at all: ``pad_to=None``).
    Their performer's global heads count every padding slot, so the same weights embed a person differently in each
    (tests/test_performer.py). ``"padded"`` alone: padded to a length not recorded, which is what every file
    written before this was recorded means."""

    mode: str = "padded"  # "padded" or "packed"
    pad_to: int | None = None  # the padded length the attention computes as; None: unpadded, or not recorded

    @classmethod
    def parse(cls, text: str) -> Padding:
        m = _PADDING.fullmatch(text.strip())
        if m is None or (m[1] == "padded" and m[3]) or (m[1] == "packed" and not (m[2] or m[3])):
            raise EmbeddingsError(f"padding {text!r}: one of 'padded pad_to=N', 'packed pad_to=N', 'packed unpadded' "
                                  "(N: the padded length, e.g. 512)")
        return cls(m[1], int(m[2]) if m[2] else None)

    @classmethod
    def from_json(cls, value: object, where: str) -> Padding:
        """A manifest's or stamp's ``"padding"`` (``where``: whose, for the error); absent (written before it was
        recorded): plain ``"padded"``."""
        try:
            return cls() if value is None else cls.parse(str(value))
        except EmbeddingsError as e:
            raise EmbeddingsError(f"{where}: {e}") from None

    def __str__(self) -> str:
        if self.pad_to is not None:
            return f"{self.mode} pad_to={self.pad_to}"
        return "packed unpadded" if self.mode == "packed" else "padded"

    def __repr__(self) -> str:
        return repr(str(self))


@dataclass(frozen=True)
class EmbeddingSpec:
    """What an output directory holds; a job writing into it must have the same."""

    dataset: str  # the dataset's fingerprint
    splits: tuple[str, ...]
    model: str  # the model's fingerprint (its parameters) or the name the user gave it
    fields: tuple[tuple[str, int], ...]  # (name, width) in column order
    dtype: str
    padding: Padding = Padding()  # how the model saw the persons: every file of the directory the same

    def to_json(self) -> dict[str, object]:
        return {"format": OUT_FORMAT, **asdict(self), "fields": dict(self.fields), "splits": list(self.splits),
                "padding": str(self.padding)}

    @classmethod
    def from_json(cls, m: dict, where: str) -> EmbeddingSpec:
        try:
            if m["format"] != OUT_FORMAT:
                raise EmbeddingsError(f"{where}: format {m['format']}, this version reads {OUT_FORMAT}")
            return cls(str(m["dataset"]), tuple(m["splits"]), str(m["model"]),
                       tuple((str(k), int(v)) for k, v in m["fields"].items()), str(m["dtype"]),
                       Padding.from_json(m.get("padding"), where))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, EmbeddingsError):
                raise
            raise EmbeddingsError(f"{where}: not an embeddings manifest ({type(e).__name__}: {e})") from None

    def schema(self) -> pa.Schema:
        item = pa.float16() if self.dtype == "float16" else pa.float32()
        return pa.schema([(ID_COLUMN, pa.int64())] + [(n, pa.list_(item, w)) for n, w in self.fields])
