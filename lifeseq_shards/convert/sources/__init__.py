"""Input readers. Each kind splits its file into independent *tasks* (row groups, row ranges) that a process pool
turns into wide int64 :class:`~lifeseq_shards.store.format.Block` s; the converter narrows and shards them. Besides the
schema's fields a source block holds ``row``: the file row of each of its input rows, for errors (it is not
stored); a source that filters persons out also gives ``every_id``, the person id of each of those rows, kept or
not, so that a duplicated id is refused whichever copy the filter keeps (without it, the rows are the persons'),
and ``drop_reason``, why each row was dropped (:mod:`.drops`; 0 for a row kept).

The kinds: the seed's step-5 encoded files (:mod:`.hdf5`), its step-4 ``sequences.parquet`` with the vocabulary
(:mod:`.parquet`), and a synthetic population in that form (:mod:`.synth`). Beside them: integers kept exactly or
refused (:mod:`.exact`) and the one error every reader raises (:mod:`.errors`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import SourceError

if TYPE_CHECKING:
    from ...store.format import Block

__all__ = ["Source", "SourceError", "input_kind", "open_sources"]


@dataclass
class Source:
    """The converter's view of its input files: their independent tasks, the picklable function that turns one task
    into a wide block (it runs in the worker processes), and what the manifest records about them."""

    kind: str  # "parquet" | "hdf5"
    tasks: list[Any]
    encode: Callable[[Any], Block]  # picklable: runs in worker processes
    offline_mlm: bool
    vocab_size: int | None  # None: unknown (an HDF5 input converted without --vocab)
    rows: int  # input rows (persons before filtering), for progress
    # task -> the encode's block without its tokens (person_id, length, row, every_id, drop_reason), cheaper than the
    # encode: what an array task needs of every person (convert/share.py); None: a kind without one (encode instead)
    survey: Callable[[Any], Block] | None = None


def open_sources(
    inputs: list[str], vocab: str | None, max_seq_len: int, time_range: tuple[int | None, int | None]
) -> Source:
    """Recognise the input kind from the file name and check every file before any work starts."""
    kinds = {input_kind(p) for p in inputs}
    if len(kinds) != 1:
        raise SourceError(f"{inputs[0]}: inputs mix kinds {sorted(kinds)}; convert one kind at a time")
    kind = kinds.pop()
    from .parquet import read_vocab

    for p in inputs:
        if not Path(p).exists():
            raise SourceError(f"{p}: no such file")
    if kind == "hdf5":
        from .hdf5 import encode_h5_task, h5_info, h5_tasks

        infos = [h5_info(p) for p in inputs]
        if len({i[1] for i in infos}) != 1:
            raise SourceError(f"{inputs[0]}: inputs mix MLM and non-MLM encoded files")
        tasks = [t for p in inputs for t in h5_tasks(p)]
        # the encoded file holds ids only: its vocabulary (when given) says how many there are, for the manifest
        vocab_size = max(read_vocab(vocab).values()) + 1 if vocab is not None else None
        encode = partial(encode_h5_task, vocab_size=vocab_size)  # token ids are checked against it
        return Source(kind, tasks, encode, infos[0][1], vocab_size, sum(i[0] for i in infos))
    if vocab is None:
        raise SourceError(f"{inputs[0]}: a parquet input needs --vocab VOCAB.csv")
    from .parquet import PREFIX_LEN, encode_parquet_task, parquet_rows, parquet_tasks, survey_parquet_task

    if max_seq_len <= PREFIX_LEN:
        raise SourceError(f"--max-seq-len {max_seq_len}: a sequence must stay below it, and its {PREFIX_LEN}-token "
                          "prefix ([CLS], background, [SEP]) alone does not")
    vocab_map = read_vocab(vocab)
    tasks = [t for p in inputs for t in parquet_tasks(p)]
    encode = partial(encode_parquet_task, vocab=vocab_map, max_seq_len=max_seq_len, time_range=time_range)
    survey = partial(survey_parquet_task, max_seq_len=max_seq_len, time_range=time_range)
    return Source(kind, tasks, encode, False, max(vocab_map.values()) + 1, sum(parquet_rows(p) for p in inputs),
                  survey)


def input_kind(path: str) -> str:
    """``"hdf5"`` or ``"parquet"``, from the file name's suffix; a SourceError for any other."""
    suffix = Path(path).suffix.lower()
    if suffix in (".h5", ".hdf5"):
        return "hdf5"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise SourceError(f"{path}: unknown input kind (expected .h5 or .parquet)")
