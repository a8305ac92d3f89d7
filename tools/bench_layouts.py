"""Which tar layout is fastest to decode into per-field arrays, for the same persons?

Issue: "measure several layouts and pick the fastest to read at the same size". Every layout holds the same
synthetic persons (ragged, realistic lengths) in one tar file; the timed part is a single process turning the file
(already in the page cache) into numpy arrays ready for batching. Layouts:

  a  one member per field per person, ``.npy`` (np.load): the plain webdataset way
  b  one member per person, raw known layout (np.frombuffer), zstd per member (our block codec with P = 1)
  c  a block of P persons per member, columnar, zstd (our format, lifeseq_shards.store.format)
  d  (c)'s tar uncompressed, then zstd over the whole file

Usage: python -m tools.bench_layouts [--people 50000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import zstandard

from lifeseq_shards.store.format import (
    Block,
    decode_block,
    decode_member,
    encode_block,
    make_schema,
    token_schema,
)
from lifeseq_shards.store.shardfile import iter_tar_members, write_shard
from tools.tables import write_csv

RAGGED_FIELDS = ("tokens", "abspos", "age", "segment")
SCHEMA = token_schema(make_schema("uint16"))  # stamps per token: these synthetic events hold one token each
BLOCK_SIZES = (64, 256, 1024, 4096)
GRID_LEVEL = 3  # the layout grid; the chosen layout is then also written at level 9 (the converter's default)
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def synthetic_persons(n: int, seed: int = 0) -> Block:
    """``n`` persons shaped like the seed's sequences: lognormal lengths (median ~134, ~15 % at the 512 cap), a
    6-token background prefix with 0 abspos/age/segment, Zipf-like token ids < 3000, ascending abspos (days)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(134), 1.3, n)), 6, 512).astype(np.int64)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    who = np.repeat(np.arange(n), lengths)
    pos = np.arange(total) - starts[who]
    tokens = (5 + (rng.zipf(1.4, total) - 1) % 2995).astype(np.uint16)
    same_day = rng.random(total) < 0.3
    gaps = np.where(same_day, 0, rng.geometric(0.02, total))
    run = np.cumsum(gaps)
    birth = rng.integers(-8000, 9000, n)
    abspos = np.minimum(birth[who] + 6000 + run - run[starts[who]], 16438)
    age = (abspos - birth[who]) // 365
    segment = np.where(same_day, 1, 2)
    prefix = pos < 6
    tokens[prefix] = np.array([1, 10, 11, 12, 13, 2], dtype=np.uint16)[pos[prefix]]
    cols = {"abspos": abspos.astype(np.int16), "age": age.astype(np.uint8), "segment": segment.astype(np.uint8)}
    for c in cols.values():
        c[prefix] = 0
    return Block({"person_id": np.arange(n, dtype=np.int64) + 10_000_000, "length": lengths.astype(np.uint16),
                  "tokens": tokens, **cols})


def blocks_of(block: Block, persons: int) -> list[Block]:
    """``block`` cut into consecutive blocks of ``persons``."""
    return [block.take(np.arange(i, min(i + persons, block.n)), SCHEMA) for i in range(0, block.n, persons)]


def person_arrays(block: Block) -> Iterable[tuple[int, dict[str, np.ndarray]]]:
    offs = block.offsets()
    for i, pid in enumerate(block.columns["person_id"].tolist()):
        yield pid, {f: block.columns[f][offs[i]:offs[i + 1]] for f in RAGGED_FIELDS}


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def npy_members(block: Block) -> Iterable[tuple[str, bytes]]:
    """Layout (a): webdataset samples ``<person_id>.<field>.npy`` (the key carries the person id)."""
    for pid, arrays in person_arrays(block):
        for f, a in arrays.items():
            yield f"{pid}.{f}.npy", npy_bytes(a)


def write_npy_tar(path: Path, block: Block) -> None:
    write_tar(path, npy_members(block))


def write_blocks_tar(path: Path, block: Block, persons: int, level: int) -> None:
    write_shard(path, blocks_of(block, persons), SCHEMA, level=level)


def write_whole_zst(path: Path, block: Block, persons: int, level: int) -> None:
    raw = path.with_suffix(".raw.tar")
    write_tar(raw, ((f"{i:06d}.block", encode_block(b, SCHEMA)) for i, b in enumerate(blocks_of(block, persons))))
    path.write_bytes(zstandard.ZstdCompressor(level=level).compress(raw.read_bytes()))
    raw.unlink()


# ---------------------------------------------------------------------------------------------------------------
# Decoders: file -> (persons, tokens). Each returns arrays a batcher can pad directly.


def decode_npy_tar(path: Path) -> tuple[int, int]:
    samples: dict[str, dict[str, np.ndarray]] = {}
    with open(path, "rb") as fh:
        for name, data in iter_tar_members(fh):
            key, field, _ = name.split(".")
            samples.setdefault(key, {})[field] = np.load(io.BytesIO(data))
    return len(samples), sum(len(s["tokens"]) for s in samples.values())


def _count(blocks: list[Block]) -> tuple[int, int]:
    return sum(b.n for b in blocks), sum(int(b.offsets()[-1]) for b in blocks)


def decode_blocks_tar(path: Path) -> tuple[int, int]:
    with open(path, "rb") as fh:
        return _count([decode_member(data, SCHEMA) for _, data in iter_tar_members(fh)])


def decode_whole_zst(path: Path) -> tuple[int, int]:
    with open(path, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as stream:
        return _count([decode_block(data, SCHEMA) for _, data in iter_tar_members(stream)])


def best_time(fn: Callable[[Path], tuple[int, int]], path: Path, repeat: int, expect: tuple[int, int]) -> float:
    """Best of ``repeat`` wall times (the least disturbed by the other jobs on a shared machine)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = fn(path)
        times.append(time.perf_counter() - t0)
        if got != expect:
            raise AssertionError(f"{path.name}: decoded {got} persons/tokens, wrote {expect}")
    return min(times)


def run(people: int, repeat: int, work: Path, out: Path | None, profile: bool) -> list[dict[str, object]]:
    persons = synthetic_persons(people)
    expect = (persons.n, int(persons.offsets()[-1]))
    cases: list[tuple[str, int, int, Callable[[Path], None], Callable[[Path], tuple[int, int]]]] = [
        ("a npy/field/person", 1, 0, lambda p: write_npy_tar(p, persons), decode_npy_tar),
        ("b raw/person zstd", 1, GRID_LEVEL, lambda p: write_blocks_tar(p, persons, 1, GRID_LEVEL), decode_blocks_tar),
    ]
    for size in BLOCK_SIZES:
        cases.append((f"c block P={size} zstd", size, GRID_LEVEL,
                      lambda p, s=size: write_blocks_tar(p, persons, s, GRID_LEVEL), decode_blocks_tar))
    rows = [measure(c, work, repeat, expect) for c in cases]
    fastest = max((r for r in rows if str(r["layout"]).startswith("c")), key=lambda r: float(r["persons_per_s"]))
    chosen = int(fastest["P"])  # type: ignore[call-overload]
    rows.append(measure((f"c block P={chosen} zstd", chosen, 9,
                         lambda p: write_blocks_tar(p, persons, chosen, 9), decode_blocks_tar), work, repeat, expect))
    rows.append(measure((f"d whole-file zstd, P={chosen}", chosen, GRID_LEVEL,
                         lambda p: write_whole_zst(p, persons, chosen, GRID_LEVEL), decode_whole_zst),
                        work, repeat, expect))
    base = rows[0]
    for r in rows:
        r["speed_vs_a"] = round(float(r["persons_per_s"]) / float(base["persons_per_s"]), 2)
        r["size_vs_a"] = round(float(r["bytes_per_person"]) / float(base["bytes_per_person"]), 3)
    print_table(rows, people, chosen)
    if out is not None:
        write_csv(out / "layouts.csv", rows)
        print(f"wrote {out / 'layouts.csv'}")
    if profile:
        path = work / "profile.tar"
        write_blocks_tar(path, persons, chosen, 9)
        profile_decode(path)
    return rows


def measure(case: tuple[str, int, int, Callable[[Path], None], Callable[[Path], tuple[int, int]]], work: Path,
            repeat: int, expect: tuple[int, int]) -> dict[str, object]:
    name, size, level, write, decode = case
    path = work / (re.sub(r"\W+", "_", name) + f"_{level}.tar")
    write(path)
    seconds = best_time(decode, path, repeat, expect)
    row = {"layout": name, "P": size, "zstd_level": level,
           "bytes_per_person": round(path.stat().st_size / expect[0], 1),
           "persons_per_s": round(expect[0] / seconds), "tokens_per_s": round(expect[1] / seconds)}
    print(f"  {name:<28} {row['bytes_per_person']:>9} B/person {row['persons_per_s']:>10} persons/s", flush=True)
    return row


def print_table(rows: list[dict[str, object]], people: int, chosen: int) -> None:
    print(f"\n{people} persons; decode = one process, file in page cache, best of the repeats; chosen P = {chosen}\n")
    print("| layout | zstd level | bytes/person | persons/s | speed vs (a) | size vs (a) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        level = r["zstd_level"] or "-"
        print(f"| {r['layout']} | {level} | {r['bytes_per_person']} | {r['persons_per_s']:,} | {r['speed_vs_a']}x"
              f" | {r['size_vs_a']}x |")


def profile_decode(path: Path) -> None:
    """Where the time of the chosen layout's decode goes (cProfile, top functions by own time)."""
    prof = cProfile.Profile()
    prof.runcall(decode_blocks_tar, path)
    print(f"\nprofile of decode_blocks_tar({path.name}):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--people", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where layouts.csv goes")
    ap.add_argument("--profile", action="store_true", help="cProfile the chosen layout's decode")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
        run(args.people, args.repeat, Path(tmp), args.out, args.profile)


if __name__ == "__main__":
    main()
