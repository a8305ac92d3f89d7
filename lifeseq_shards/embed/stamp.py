"""The provenance stamp of an embedding file: what it was written from, kept in its own Parquet key-value metadata.

Every per-shard file carries, under :data:`STAMP_KEY`, the dataset's and the model's fingerprints (as in
``_embeddings.json``), the input shard it embeds, its person count and a digest of its contents (person ids and
vectors, column by column). A file copied in from another run, moved to another shard's name, cut short, or with
rows deleted or vectors moved between persons no longer matches its stamp or its directory's ``_embeddings.json``.
The footer alone (:func:`provenance_problem`) says where a file comes from; the digest (:func:`content_problem`)
needs every row. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .spec import ID_COLUMN, EmbeddingsError, EmbeddingSpec, Padding

OUT_MANIFEST = "_embeddings.json"  # "_": pyarrow, pandas and polars read the directory as one table without it
STAMP_KEY = b"lifeseq_shards.embedding"
REEMBED = "delete it and run the embedding job again (it embeds the missing shards only)"


@dataclass(frozen=True)
class Stamp:
    """Where one embedding file comes from, and what it holds."""

    dataset: str  # the dataset's fingerprint
    model: str  # the model's fingerprint, or the name the user gave it (``_embeddings.json``'s "model")
    shard: str  # the input shard (its manifest path)
    persons: int
    digest: str  # sha256 of the contents, see content_digest
    padding: Padding = Padding()  # how the model saw the persons (a stamp without it: plain "padded")

    def metadata(self) -> dict[bytes, bytes]:
        return {STAMP_KEY: json.dumps({**asdict(self), "padding": str(self.padding)}, sort_keys=True).encode()}

    @classmethod
    def of(cls, metadata: dict[bytes, bytes] | None) -> Stamp | None:
        """The stamp in a file's key-value metadata; None if it has none (written before stamps) or a damaged one."""
        raw = (metadata or {}).get(STAMP_KEY)
        if raw is None:
            return None
        try:
            d = json.loads(raw)
            return cls(str(d["dataset"]), str(d["model"]), str(d["shard"]), int(d["persons"]), str(d["digest"]),
                       Padding.from_json(d.get("padding"), "stamp"))
        except (ValueError, KeyError, TypeError):
            return None


def output_of(shard: str) -> str:
    """The output file of an input shard (its manifest path): ``.parquet`` for ``.tar``."""
    return str(Path(shard).with_suffix(".parquet"))


def content_digest(batches: Iterable[pa.RecordBatch], spec: EmbeddingSpec) -> str:
    """sha256 over the person ids (int64) and each field's values (in the spec's dtype), a column at a time and in
    row order; the same rows in any batching give the same digest, so it can be taken while streaming."""
    names = [ID_COLUMN, *(n for n, _ in spec.fields)]
    hashers = {n: hashlib.sha256() for n in names}
    for batch in batches:
        hashers[ID_COLUMN].update(np.asarray(batch.column(ID_COLUMN).to_numpy(), dtype=np.int64).tobytes())
        for name, _ in spec.fields:
            values = batch.column(name).flatten().to_numpy(zero_copy_only=False)
            hashers[name].update(np.asarray(values, dtype=spec.dtype).tobytes())
    whole = hashlib.sha256()
    for n in names:
        whole.update(n.encode() + b"\0" + hashers[n].digest())
    return "sha256:" + whole.hexdigest()


def stamp_table(table: pa.Table, spec: EmbeddingSpec, shard: str) -> pa.Table:
    """``table`` (one input shard's rows, as written) with its stamp in the schema's metadata."""
    stamp = Stamp(spec.dataset, spec.model, shard, table.num_rows, content_digest(table.to_batches(), spec),
                  spec.padding)
    return table.replace_schema_metadata(stamp.metadata())


def provenance_problem(path: Path, rel: str, spec: EmbeddingSpec, listed: int) -> tuple[str | None, Stamp | None]:
    """From the footer only: the first way the file at ``path`` (``rel`` in its directory) is not the one
    ``_embeddings.json`` (``spec``, ``listed`` persons) expects there, as one line naming it, or None; and its
    stamp. Files without a stamp (written before stamps existed) are refused with how to embed them again. A file
    embedded with another :class:`Padding` than the directory's is not a problem to list but a mix to refuse:
    :class:`EmbeddingsError` (one line naming it)."""
    try:
        meta = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as e:
        return f"{rel}: unreadable ({' '.join(str(e).split())}): {REEMBED}", None
    stamp = Stamp.of(meta.metadata)
    if stamp is None:
        return (f"{rel}: no provenance stamp (written by an older version, or not by the EmbeddingWriter): "
                f"{REEMBED}"), None
    for what, got, want in (("dataset", stamp.dataset, spec.dataset), ("model", stamp.model, spec.model)):
        if got != want:
            return (f"{rel}: embeddings of {what} {got} (its stamp), but {OUT_MANIFEST} says {want}: a file of "
                    f"another run; {REEMBED}"), stamp
    if stamp.padding != spec.padding:
        raise EmbeddingsError(f"{path}: embedded with padding {stamp.padding!r} (its stamp), but {OUT_MANIFEST} "
                              f"says {spec.padding!r}: embeddings of one model in two padding modes differ, and are "
                              f"never mixed; {REEMBED} with padding={str(spec.padding)!r}")
    if not meta.schema.to_arrow_schema().equals(spec.schema()):
        return f"{rel}: its columns are not the ones {OUT_MANIFEST} names: {REEMBED}", stamp
    if output_of(stamp.shard) != rel:
        return f"{rel}: the embeddings of input shard {stamp.shard} (its stamp), not of this one: {REEMBED}", stamp
    if not meta.num_rows == stamp.persons == listed:
        return (f"{rel}: {meta.num_rows} persons, its stamp says {stamp.persons} and {OUT_MANIFEST} {listed} "
                f"(rows deleted or added after it was written): {REEMBED}"), stamp
    return None, stamp


def content_problem(rel: str, batches: Iterable[pa.RecordBatch], spec: EmbeddingSpec, stamp: Stamp) -> str | None:
    """One line naming ``rel`` if its rows (ids and vectors) are not the ones its stamp was made from, else None."""
    if content_digest(batches, spec) != stamp.digest:
        return f"{rel}: contents differ from its stamp (ids or vectors changed after it was written): {REEMBED}"
    return None
