"""Tokenise the seed's step-4 ``sequences.parquet`` into blocks, exactly as the seed's step 5 does.

Checked against the sample's ``encoded_nomlm.h5`` (tests/convert/test_parquet_source.py): events with abspos in the
closed range ``time_range`` are kept; a person needs at least ``MIN_EVENTS`` of them; the sequence is
``[CLS] origin gender birth_month birth_year [SEP]`` (0 for abspos/age/segment) followed by each event's tokens and a
``[SEP]`` (the event's abspos/age/segment repeated); only the most recent events whose total length, prefix
included, stays below ``max_seq_len`` are kept. Unknown tokens and missing background become ``[UNK]``.

The work is vectorised per row group: the ``list<list<string>>`` column is flattened once, every string is looked up
in the vocabulary by arrow's hash kernel, and the per-person layout is built from offsets with numpy, so no Python
code runs per token or per event. One row group is read at a time, which bounds memory.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ...store.format import SPECIAL_TOKENS, STAMPS, Block
from .drops import DROP_REASON, KEPT, MIN_EVENTS, TOO_FEW_EVENTS
from .errors import SourceError
from .exact import exact_int64

PERSON, BACKGROUND, SENTENCE = "RINPERSOON", "background", "sentence"
COLUMNS = (PERSON, BACKGROUND, SENTENCE, *STAMPS)
SURVEY_COLUMNS = (PERSON, SENTENCE, "abspos")  # what a person's id, length and drop reason need
BACKGROUND_ORDER = ("origin", "gender", "birth_month", "birth_year")  # order of the prefix after [CLS]
PREFIX_LEN = 2 + len(BACKGROUND_ORDER)
DEFAULT_TIME_RANGE: tuple[int | None, int | None] = (None, 16438)
TOKEN_ID_MAX = np.iinfo(np.uint32).max


_NOT_CSV = {b"PAR1": "Parquet", b"\x89HDF\r\n\x1a\n": "HDF5"}  # the files' magic bytes


def read_vocab(path: str | os.PathLike[str]) -> dict[str, int]:
    """TOKEN -> ID from the seed's vocab.csv; rejects what would make the ids ambiguous, or the specials unknown or
    not at IDs 0-4 (where the masker and the padding take them to be)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SourceError(f"{path}: cannot read vocabulary ({e.strerror or e})") from None
    for magic, kind in _NOT_CSV.items():  # the sequences passed as --vocab, say: named, not "not UTF-8"
        if raw.startswith(magic):
            raise SourceError(f"{path}: not a vocabulary CSV (a {kind} file); --vocab takes the seed's vocab.csv "
                              "(TOKEN, CATEGORY, ID)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise SourceError(f"{path}: line {line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = {"TOKEN", "ID"} - set(reader.fieldnames or ())
    if missing:
        raise SourceError(f"{path}: vocabulary lacks column(s) {', '.join(sorted(missing))}")
    rows = [(r["TOKEN"], r["ID"], reader.line_num) for r in reader]
    vocab: dict[str, int] = {}
    seen: dict[int, str] = {}
    lines: dict[str, int] = {}
    for token, raw_id, line in rows:
        try:
            i = int(raw_id)
        except (TypeError, ValueError):
            raise SourceError(f"{path}: line {line}: ID {raw_id!r} is not an integer") from None
        if not 0 <= i <= TOKEN_ID_MAX:
            raise SourceError(f"{path}: line {line}: ID {i} outside [0, {TOKEN_ID_MAX}] (token ids are uint32 at most)")
        if i in seen:
            raise SourceError(f"{path}: line {line}: ID {i} given to both {seen[i]!r} and {token!r}")
        if token in vocab:
            raise SourceError(f"{path}: line {line}: token {token!r} listed twice")
        vocab[token], seen[i] = i, token
        lines[token] = line
    absent = [s for s in SPECIAL_TOKENS if s not in vocab]
    if absent:
        raise SourceError(f"{path}: vocabulary lacks special token(s) {' '.join(absent)}")
    for want, s in enumerate(SPECIAL_TOKENS):  # the masker, the padding and the seed's step 5 use these ids
        if vocab[s] != want:
            raise SourceError(f"{path}: line {lines[s]}: {s} has ID {vocab[s]}; the specials "
                              f"{' '.join(SPECIAL_TOKENS)} must be IDs 0-{len(SPECIAL_TOKENS) - 1} in that order (the "
                              "masking and padding assume them)")
    return vocab


def _open(path: str, dictionary: bool = False) -> pq.ParquetFile:
    """Open ``path``; with ``dictionary`` its string columns are read dictionary-encoded (see :func:`_lookup`)."""
    try:
        pf = pq.ParquetFile(path)
        if not dictionary:
            return pf
        leaves = [pf.schema.column(i) for i in range(pf.metadata.num_columns)]
        strings = [c.path for c in leaves if c.physical_type == "BYTE_ARRAY" and c.path.split(".")[0] in COLUMNS]
        return pq.ParquetFile(path, read_dictionary=strings)
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{path}: not a readable parquet file ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def parquet_tasks(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """One (path, row group) unit of work per row group, after checking the file opens and has the needed columns."""
    p = str(Path(path))
    pf = _open(p)
    names = set(pf.schema_arrow.names)
    for col in COLUMNS:
        if col not in names:
            raise SourceError(f"{p}: missing column {col!r} (has {', '.join(pf.schema_arrow.names)})")
        typ = pf.schema_arrow.field(col).type
        expected, fits = COLUMN_TYPES[col]
        if not fits(typ):
            raise SourceError(f"{p}: column {col!r} is {typ}, expected {expected}")
    if pf.metadata.num_rows == 0 or pf.num_row_groups == 0:
        raise SourceError(f"{p}: no rows")
    return [(p, g) for g in range(pf.num_row_groups)]


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        pa.types.is_dictionary(t) and _is_text(t.value_type))


def _is_list_of(t: pa.DataType, inner: Callable[[pa.DataType], bool]) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and inner(t.value_type)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


# per column: (what it must be, its test); strings must be UTF-8 text (binary would never match the vocabulary)
COLUMN_TYPES: dict[str, tuple[str, Callable[[pa.DataType], bool]]] = {
    PERSON: ("integers", _is_number),
    # every field of the prefix present: a missing (renamed) one would make every person's token [UNK] unseen
    BACKGROUND: (f"struct<{', '.join(sorted(BACKGROUND_ORDER))}: string>",
                 lambda t: pa.types.is_struct(t) and all(_is_text(f.type) for f in t)
                 and set(BACKGROUND_ORDER) <= {f.name for f in t}),
    SENTENCE: ("list<list<string>>", lambda t: _is_list_of(t, lambda e: _is_list_of(e, _is_text))),
    **{c: ("list<integer>", lambda t: _is_list_of(t, _is_number)) for c in STAMPS},
}


def parquet_rows(path: str | os.PathLike[str]) -> int:
    """Input rows (persons before filtering), for progress reporting."""
    return int(_open(str(path)).metadata.num_rows)


def _list_offsets(arr: pa.Array) -> np.ndarray:
    """Offsets (len+1) of a list array from its value lengths (nulls count as empty; slices are honoured)."""
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _first_invalid_utf8(strings: pa.Array) -> int | None:
    """Position of the first string that is not UTF-8 (parquet does not check; the vocabulary lookup would make it
    [UNK] without a word), or None. Validates a dictionary's distinct strings only; the search runs only on failure."""
    values = strings.dictionary if pa.types.is_dictionary(strings.type) else strings
    try:
        values.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    bad = [i for i, b in enumerate(values.cast(pa.binary()).to_pylist()) if b is not None and not _decodes(b)]
    if values is strings:
        return bad[0]
    used = pc.is_in(strings.indices, value_set=pa.array(bad, type=strings.indices.type))
    at = np.flatnonzero(pc.fill_null(used, False).to_numpy(zero_copy_only=False))
    return int(at[0]) if at.size else None  # an unused bad dictionary entry harms nothing


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _token_index(strings: pa.Array, keys: pa.Array, ids: np.ndarray, unk: int) -> tuple[np.ndarray, np.ndarray]:
    """(table, index) with ``table[index]`` = the vocabulary ids of ``strings`` (nulls and unknown strings ->
    ``unk``), found by one hash join in arrow. A dictionary-encoded array (how :func:`_open` reads the strings) is
    looked up on its distinct strings only, and its indices are used as they are (no copy when there are no nulls)."""
    if pa.types.is_dictionary(strings.type):
        table = _lookup(strings.dictionary, keys, ids, unk)
        index = strings.indices
    else:
        table, index = ids, pc.index_in(strings, value_set=keys)
    table = np.append(table, unk)
    if index.null_count:
        index = pc.fill_null(index, len(table) - 1)
    return table, index.to_numpy(zero_copy_only=False)


def _lookup(strings: pa.Array, keys: pa.Array, ids: np.ndarray, unk: int) -> np.ndarray:
    table, index = _token_index(strings, keys, ids, unk)
    return table[index]


def _prefix(background: pa.Array, keys: pa.Array, ids: np.ndarray, vocab: dict[str, int],
            row: Callable[[int], str]) -> np.ndarray:
    """(n, PREFIX_LEN) prefix tokens; a null background (or field) gives [UNK], a string that is not UTF-8 an error
    naming ``row(r)``."""
    n = len(background)
    out = np.empty((n, PREFIX_LEN), dtype=np.int64)
    out[:, 0], out[:, -1] = vocab["[CLS]"], vocab["[SEP]"]
    fields = dict(zip([f.name for f in background.type], background.flatten(), strict=True))  # applies parent nulls
    for j, name in enumerate(BACKGROUND_ORDER, start=1):
        col = fields.get(name)
        bad = None if col is None else _first_invalid_utf8(col)
        if bad is not None:
            raise SourceError(f"{row(bad)}: {BACKGROUND}.{name} is not UTF-8")
        out[:, j] = vocab["[UNK]"] if col is None else _lookup(col, keys, ids, vocab["[UNK]"])
    return out


def _segment_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``values`` of the given lengths."""
    cum = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=cum[1:])
    ends = np.cumsum(counts)
    return cum[ends] - cum[ends - counts]


def encode_parquet_task(
    task: tuple[str, int],
    vocab: dict[str, int],
    max_seq_len: int = 512,
    time_range: tuple[int | None, int | None] = DEFAULT_TIME_RANGE,
    select: np.ndarray | None = None,
) -> Block:
    """Tokenise one row group into a block (int64 columns) of the persons that survive the filters, in file order;
    with ``select`` (person ids, sorted) only those of them (an array task's share: every row is still read and
    checked, only the selected persons' tokens are built)."""
    return _encode(task, vocab, max_seq_len, time_range, select)


def survey_parquet_task(
    task: tuple[str, int],
    max_seq_len: int = 512,
    time_range: tuple[int | None, int | None] = DEFAULT_TIME_RANGE,
) -> Block:
    """What an array task needs of every person of one row group, without tokenising anyone: the
    :func:`encode_parquet_task` block's ``person_id``, ``length``, ``row``, ``every_id`` and ``drop_reason``, the
    same values, from the id, sentence and abspos columns only."""
    return _encode(task, None, max_seq_len, time_range, None)


# One function, over 60 lines: one vectorised pass over a row group in the seed's step-5 order (read, check, time
# slice, the events that fit, units, tokens), whose stages share a dozen offset and index arrays; each stage is a
# commented paragraph, and the seed's encoded_nomlm.h5 checks the whole (tests/convert/test_parquet_source.py).
# Without ``vocab`` it stops before the tokens (the survey), with ``select`` it tokenises those persons only.
def _encode(task: tuple[str, int], vocab: dict[str, int] | None, max_seq_len: int,
            time_range: tuple[int | None, int | None], select: np.ndarray | None) -> Block:
    path, group = task
    where = f"{path}: row group {group}"
    columns = COLUMNS if vocab is not None else SURVEY_COLUMNS
    try:
        pf = _open(path, dictionary=True)
        table = pf.read_row_group(group, columns=list(columns))
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"{where}: cannot be read ({_one_line(e)})") from None
    except KeyError as e:
        raise SourceError(f"{where}: missing column {e}") from None
    cols = {c: table.column(c).combine_chunks() for c in columns}
    first = sum(pf.metadata.row_group(g).num_rows for g in range(group))  # the file row of the group's row 0

    def row(r: int) -> str:
        return f"{path}: row {first + r}"

    if cols[PERSON].null_count:
        r = int(np.flatnonzero(cols[PERSON].is_null().to_numpy(zero_copy_only=False))[0])
        raise SourceError(f"{row(r)}: no person id in column {PERSON!r}")
    person = exact_int64(cols[PERSON].to_numpy(zero_copy_only=False), f"column {PERSON!r}", row)

    def person_row(r: int) -> str:
        return f"{row(r)} (person {person[r]})"

    # events: per-person offsets, per-event token offsets, per-token ids (as table[index])
    sentence = cols[SENTENCE]
    ev_off = _list_offsets(sentence)
    events = sentence.flatten()
    tok_off = _list_offsets(events)

    def event_row(k: int) -> str:  # the person row of flat event k
        return person_row(int(np.searchsorted(ev_off, k, "right")) - 1)

    n_events = np.diff(ev_off)
    per_event = {}
    for c in (c for c in columns if c in STAMPS):  # the stamps read
        off = _list_offsets(cols[c])
        bad = np.flatnonzero(np.diff(off) != n_events)
        if bad.size:
            r = int(bad[0])
            raise SourceError(f"{person_row(r)}: {c} has {off[r + 1] - off[r]} values for {n_events[r]} events")
        values = cols[c].flatten()
        if values.null_count:
            k = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            raise SourceError(f"{event_row(k)}: null {c} value")
        per_event[c] = exact_int64(values.to_numpy(zero_copy_only=False), f"column {c!r} value", event_row)

    # time slice, then the minimum number of events
    keep = np.ones(len(tok_off) - 1, dtype=bool)
    lo, hi = time_range
    if lo is not None:
        keep &= per_event["abspos"] >= lo
    if hi is not None:
        keep &= per_event["abspos"] <= hi
    enough = _segment_sums(keep, n_events) >= MIN_EVENTS
    keep &= np.repeat(enough, n_events)
    persons = np.flatnonzero(enough)
    ev = np.flatnonzero(keep)
    counts = _segment_sums(keep, n_events)[persons]

    # the most recent events that fit: suffix sums of event lengths (+1 for [SEP]) within each person
    ev_len = tok_off[ev + 1] - tok_off[ev] + 1
    cum = np.cumsum(ev_len)
    person_end = np.repeat(cum[np.cumsum(counts) - 1], counts)  # cum at each event's person's last event
    fits = PREFIX_LEN + person_end - cum + ev_len < max_seq_len
    counts = _segment_sums(fits, counts)
    ev, ev_len = ev[fits], ev_len[fits]
    # every input row and its person, kept or not: a duplicated id is refused even when the filter drops one
    out = {"row": first + np.arange(len(person)), "every_id": person,
           DROP_REASON: np.where(enough, KEPT, TOO_FEW_EVENTS)}
    if vocab is None:
        return Block({"person_id": person[persons], "length": PREFIX_LEN + _segment_sums(ev_len, counts), **out})
    if select is not None:
        chosen = np.isin(person[persons], select)
        ev_chosen = np.repeat(chosen, counts)
        persons, counts, ev, ev_len = persons[chosen], counts[chosen], ev[ev_chosen], ev_len[ev_chosen]

    # the tokens: each string's vocabulary id (not UTF-8: an error naming the row)
    keys = pa.array(list(vocab), type=pa.string())
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
    unk, sep = vocab["[UNK]"], vocab["[SEP]"]
    strings = events.flatten()
    bad_token = _first_invalid_utf8(strings)
    if bad_token is not None:
        k = int(np.searchsorted(tok_off, bad_token, "right")) - 1
        raise SourceError(f"{event_row(k)}: column {SENTENCE!r} holds a token that is not UTF-8")
    tok_table, tok_index = _token_index(strings, keys, ids, unk)

    # units: per person its prefix (PREFIX_LEN tokens), then each kept event (its tokens, then [SEP])
    k, m = len(persons), len(ev)
    first_ev = np.cumsum(counts) - counts
    prefix_unit = first_ev + np.arange(k)
    is_event = np.ones(k + m, dtype=bool)
    is_event[prefix_unit] = False
    unit_len = np.full(k + m, PREFIX_LEN, dtype=np.int64)
    unit_len[is_event] = ev_len
    unit_event = np.zeros(k + m, dtype=np.int64)
    unit_event[is_event] = ev
    unit_src = np.zeros(k + m, dtype=np.int64)
    unit_src[is_event] = tok_off[ev]
    unit_out = np.cumsum(unit_len) - unit_len
    total = int(unit_len.sum())

    # per output position: the source token (clipped: [SEP] and prefix positions are overwritten below) and event
    src = np.repeat(unit_src - unit_out, unit_len)
    src += np.arange(total, dtype=np.int64)
    tokens = tok_table[np.take(tok_index, src, mode="clip")] if len(tok_index) else np.zeros(total, np.int64)
    tokens[unit_out[is_event] + ev_len - 1] = sep
    prefix_at = (unit_out[prefix_unit][:, None] + np.arange(PREFIX_LEN)).ravel()
    tokens[prefix_at] = _prefix(cols[BACKGROUND], keys, ids, vocab, person_row)[persons].ravel()
    out.update(person_id=person[persons], tokens=tokens, length=PREFIX_LEN + _segment_sums(ev_len, counts))
    out_event = np.repeat(unit_event, unit_len)
    for c in STAMPS:
        values = np.take(per_event[c], out_event) if m else np.zeros(total, np.int64)
        values[prefix_at] = 0
        out[c] = values
    return Block(out)
