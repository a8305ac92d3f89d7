"""A synthetic population in the seed's step-4 form (``sequences.parquet`` + ``vocab.csv``), for scale tests.

The sample has 6,000 persons whose sequences never reach the 512-token cap; real data reaches it often, so the
number of events per person is lognormal (long tail: ~15% of persons are truncated, ~3% have too few events). Row
groups are generated independently (their own RNG stream from ``(seed, group)``) and written as they are made, so
memory is bounded by one row group, and the output depends only on ``seed`` and ``rows_per_group``. Everything is
vectorised per row group; the list columns are built from offsets, never from Python lists.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...progress import progress_bar
from ...store.format import SPECIAL_TOKENS

# event kinds: (category prefix, its fields); an event has one token per field, `FIELD_value`.
EVENT_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("household", ("TYPHH", "PLHH", "AANTALPERSHH", "beg_or_end")),
    ("education", ("OPLNIV", "OPLRICHTING")),
    ("network", ("n_family", "n_household", "n_colleague", "n_classmate", "n_neighbor")),
    ("job", ("SBASISLOON", "SCONTRACTSOORT", "SDATUMAANVANG", "SSOORTBAAN", "SDIENSTVERBAND", "job_beg_or_end")),
    ("income", ("INPBELI", "INPBRUTO", "INPEMEZ")),
    ("move", ("GBAGEMEENTE",)),
)
KIND_WEIGHTS = np.array([0.25, 0.1, 0.2, 0.2, 0.15, 0.1])
VALUES_PER_FIELD = 120  # value 0 is "Others" (the most frequent), then 1..119
YEARS = range(1940, 2021)  # in the vocabulary; births stop earlier so that few persons lack in-range events
BIRTH_YEARS = range(1940, 2013)
MUNICIPALITIES = 400
GENDERS = ("gender_1", "gender_2", "gender_MISSING")
GENDER_WEIGHTS = np.array([0.495, 0.495, 0.01])

EVENTS_MEDIAN, EVENTS_SIGMA, EVENTS_MAX = 40.0, 1.1, 300  # lognormal events per person
ABSPOS_END = 18000  # days since 1971-12-30; the default time range ends at 16438, so some events fall outside
SAME_DAY_RATE = 0.12  # share of events on the same day as the person's previous one (segment 1)
UNKNOWN_RATE = 0.001  # share of tokens that are not in the vocabulary
NULL_BACKGROUND_RATE = 0.002
ID_BITS = 30  # person ids: a bijective mix of the row number in [0, 2**30): unique, random-looking, 9-10 digits

SCHEMA = pa.schema(
    [
        ("RINPERSOON", pa.int64()),
        (
            "background",
            pa.struct([(k, pa.string()) for k in ("birth_month", "birth_year", "gender", "origin")]),
        ),
        ("sentence", pa.list_(pa.list_(pa.dictionary(pa.int32(), pa.string())))),
        ("abspos", pa.list_(pa.int64())),
        ("age", pa.list_(pa.int64())),
        ("segment", pa.list_(pa.int64())),
    ]
)


def _vocab() -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
    """(token, category) in id order; per event kind its first field's index and field count; per field its first id."""
    rows = [(s, "GENERAL") for s in SPECIAL_TOKENS]
    rows += [(g, "BACKGROUND") for g in GENDERS]
    rows += [(f"month_{m}", "background_month") for m in range(1, 13)]
    rows += [(f"year_{y}", "background_year") for y in YEARS]
    rows += [(f"municipality_{m}", "background_municipality") for m in range(MUNICIPALITIES)]
    kind_fields = np.zeros((len(EVENT_KINDS), 2), dtype=np.int64)
    field_base = []
    for k, (kind, fields) in enumerate(EVENT_KINDS):
        kind_fields[k] = (len(field_base), len(fields))
        for field in fields:
            field_base.append(len(rows))
            rows += [(f"{field}_Others", f"{kind}_{field}")]
            rows += [(f"{field}_{v}", f"{kind}_{field}") for v in range(1, VALUES_PER_FIELD)]
    return rows, kind_fields.astype(np.int32), np.array(field_base, dtype=np.int32)


def _person_ids(index: np.ndarray, key: int) -> np.ndarray:
    """A bijection of [0, 2**ID_BITS): xor with a seeded key, then xorshift-multiply rounds (each one invertible)."""
    mask = np.uint64((1 << ID_BITS) - 1)
    x = (index.astype(np.uint64) ^ np.uint64(key)) & mask
    for mult in (0x2C1B3C6D, 0x297A2D39):
        x ^= x >> np.uint64(ID_BITS // 2)
        x = (x * np.uint64(mult)) & mask
    x ^= x >> np.uint64(ID_BITS // 2)
    return x.astype(np.int64)


# value index of a field from a uniform byte: skewed like u**3 (value 0, "Others", takes the largest share)
_SKEW = ((np.arange(256) / 256) ** 3 * VALUES_PER_FIELD).astype(np.int32)


def _sorted_uniform(rng: np.random.Generator, counts: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """``counts[i]`` sorted uniforms in [0, 1) for each i, without sorting: the normalised partial sums of
    ``counts[i] + 1`` exponential gaps are distributed as the order statistics of ``counts[i]`` uniforms."""
    gaps = rng.standard_exponential(len(owner) + len(counts))
    ends = np.cumsum(counts + 1)  # one extra gap per person closes its interval
    total = np.cumsum(gaps)
    base = np.concatenate(([0.0], total[ends[:-1] - 1]))  # sum of all earlier persons' gaps
    span = total[ends - 1] - base
    events = np.ones(len(gaps), dtype=bool)
    events[ends - 1] = False
    return (total[events] - base[owner]) / span[owner]


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > np.iinfo(np.int32).max:
        raise ValueError("a row group holds more than 2**31 values: choose a smaller rows_per_group")
    return out.astype(np.int32)


# One function, over 60 lines: one vectorised draw of a group of persons, each column drawn from the ones before
# it (birth, then events and their ages, then the tokens); the arrays are only meaningful together.
def _group(
    rng: np.random.Generator,
    first: int,
    n: int,
    id_key: int,
    strings: pa.Array,
    kind_fields: np.ndarray,
    field_base: np.ndarray,
) -> pa.Table:
    """Persons ``first .. first+n-1`` as one arrow table in the step-4 schema."""
    person = _person_ids(np.arange(first, first + n), id_key)

    # background (as vocabulary ids into `strings`)
    year = rng.integers(BIRTH_YEARS.start, BIRTH_YEARS.stop, n)
    month = rng.integers(1, 13, n)
    birth = np.floor((year - 1972) * 365.25 + (month - 1) * 30.44 + rng.integers(0, 29, n) + 1).astype(np.int64)
    base = len(SPECIAL_TOKENS) + len(GENDERS)
    gender = len(SPECIAL_TOKENS) + rng.choice(len(GENDERS), n, p=GENDER_WEIGHTS)
    month_id = base + month - 1
    year_id = base + 12 + (year - YEARS.start)
    origin = base + 12 + len(YEARS) + (rng.random(n) ** 2 * MUNICIPALITIES).astype(np.int64)  # a few big ones
    valid = rng.random(n) >= NULL_BACKGROUND_RATE
    background = pa.StructArray.from_arrays(
        [strings.take(pa.array(a)) for a in (month_id, year_id, gender, origin)],
        names=["birth_month", "birth_year", "gender", "origin"],
        mask=pa.array(~valid),
    )

    # events: count, kind, day (sorted within the person, some on the previous event's day), age, segment
    n_events = np.minimum(np.rint(rng.lognormal(np.log(EVENTS_MEDIAN), EVENTS_SIGMA, n)), EVENTS_MAX).astype(np.int64)
    owner = np.repeat(np.arange(n, dtype=np.int64), n_events)
    n_ev = len(owner)
    start = np.clip(birth, 0, ABSPOS_END - 1)
    day = start[owner] + _sorted_uniform(rng, n_events, owner) * (ABSPOS_END + 1 - start)[owner]
    day = day.astype(np.int64)
    same_person = np.zeros(n_ev, dtype=bool)
    same_person[1:] = owner[1:] == owner[:-1]
    repeat_day = same_person & (rng.random(n_ev) < SAME_DAY_RATE)
    # an event on the previous event's day: take that day from the last event not so marked (still sorted)
    last_kept = np.maximum.accumulate(np.where(repeat_day, 0, np.arange(n_ev)))
    day = day[last_kept]
    same_day = np.zeros(n_ev, dtype=bool)
    same_day[1:] = same_person[1:] & (day[1:] == day[:-1])
    segment = np.where(same_day, 1, 2)
    age = np.maximum((day - birth[owner]) / 365.25, 0).astype(np.int64)

    # tokens: one per field of the event's kind; skewed values (value 0 = "Others" most often)
    kind = rng.choice(len(EVENT_KINDS), n_ev, p=KIND_WEIGHTS / KIND_WEIGHTS.sum())
    first_field, n_tok = kind_fields[kind, 0], kind_fields[kind, 1]
    tok_off = _offsets(n_tok)
    field_of_tok = np.arange(int(tok_off[-1]), dtype=np.int32) + np.repeat(first_field - tok_off[:-1], n_tok)
    tok = field_base[field_of_tok] + _SKEW[rng.integers(0, len(_SKEW), len(field_of_tok), dtype=np.uint8)]
    tok[rng.integers(0, len(tok), rng.binomial(len(tok), UNKNOWN_RATE))] = len(strings) - 1  # not in the vocabulary

    ev_off = pa.array(_offsets(n_events))
    sentence = pa.ListArray.from_arrays(
        ev_off,
        pa.ListArray.from_arrays(pa.array(tok_off), pa.DictionaryArray.from_arrays(tok, strings)),
    )
    per_event = [pa.ListArray.from_arrays(ev_off, pa.array(v)) for v in (day, age, segment)]
    return pa.Table.from_arrays([pa.array(person), background, sentence, *per_event], schema=SCHEMA)


def synth_population(
    out_dir: str | os.PathLike[str], people: int, seed: int = 0, rows_per_group: int = 50_000, progress: bool = True
) -> None:
    """Write ``out_dir/sequences.parquet`` and ``out_dir/vocab.csv`` (each to a temp name, then renamed)."""
    if people < 1 or rows_per_group < 1:
        raise ValueError("people and rows_per_group must be positive")
    if people > 1 << ID_BITS:
        raise ValueError(f"at most {1 << ID_BITS} people (person ids are {ID_BITS}-bit)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, kind_fields, field_base = _vocab()
    vocab_tmp = out / "vocab.csv.tmp"
    with open(vocab_tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["TOKEN", "CATEGORY", "ID"])
        w.writerows((tok, cat, i) for i, (tok, cat) in enumerate(rows))
    strings = pa.array([tok for tok, _ in rows] + ["UNSEEN_token"], type=pa.string())
    id_key = int(np.random.default_rng([seed, 1 << 32]).integers(0, 1 << ID_BITS))
    seq_tmp = out / "sequences.parquet.tmp"
    # store_schema=False: the file's arrow schema is then plain string, like the seed's (the dictionary only
    # saves re-hashing every token string on write)
    with (
        pq.ParquetWriter(seq_tmp, SCHEMA, store_schema=False, write_statistics=False) as writer,
        progress_bar(total=people, unit="person", disable=not progress, desc="synth") as bar,
    ):
        for g, first in enumerate(range(0, people, rows_per_group)):
            n = min(rows_per_group, people - first)
            table = _group(np.random.default_rng([seed, g]), first, n, id_key, strings, kind_fields, field_base)
            writer.write_table(table, row_group_size=n)
            bar.update(n)
    os.replace(vocab_tmp, out / "vocab.csv")
    os.replace(seq_tmp, out / "sequences.parquet")
