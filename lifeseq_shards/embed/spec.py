"""What an embedding output directory holds (:class:`EmbeddingSpec`, its ``_embeddings.json``), and the error of a
directory or batch that does not match it. Both the directory (:mod:`.store`) and the files' stamps (:mod:`.stamp`)
are checked against it, so it sits below both. No torch here."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa

OUT_FORMAT = 1
ID_COLUMN = "person_id"


class EmbeddingsError(ValueError):
    """An output directory that is not the one asked for, or a batch that does not fit it; one line naming it."""


@dataclass(frozen=True)
class EmbeddingSpec:
    """What an output directory holds; a job writing into it must have the same."""

    dataset: str  # the dataset's fingerprint
    splits: tuple[str, ...]
    model: str  # the model's fingerprint (its parameters) or the name the user gave it
    fields: tuple[tuple[str, int], ...]  # (name, width) in column order
    dtype: str

    def to_json(self) -> dict[str, object]:
        return {"format": OUT_FORMAT, **asdict(self), "fields": dict(self.fields), "splits": list(self.splits)}

    @classmethod
    def from_json(cls, m: dict, where: str) -> EmbeddingSpec:
        try:
            if m["format"] != OUT_FORMAT:
                raise EmbeddingsError(f"{where}: format {m['format']}, this version reads {OUT_FORMAT}")
            return cls(str(m["dataset"]), tuple(m["splits"]), str(m["model"]),
                       tuple((str(k), int(v)) for k, v in m["fields"].items()), str(m["dtype"]))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, EmbeddingsError):
                raise
            raise EmbeddingsError(f"{where}: not an embeddings manifest ({type(e).__name__}: {e})") from None

    def schema(self) -> pa.Schema:
        item = pa.float16() if self.dtype == "float16" else pa.float32()
        return pa.schema([(ID_COLUMN, pa.int64())] + [(n, pa.list_(item, w)) for n, w in self.fields])
