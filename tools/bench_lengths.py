"""The time to get a split's lengths (what the token-budget plan needs) from its lengths index against decoding its
blocks, both through :func:`lifeseq_shards.store.lengths.split_lengths` (``index=False`` for the blocks), on the
sample's encoded_nomlm.h5 and on `shardify synth` populations, each converted with the default options into
``--work``. Each way is timed ``--repeats`` times in turn, the median kept; the files are in the page cache (just
written), so this is the CPU's share, not a cold read. Prints a markdown table.

    python -m tools.bench_lengths --sample ../shared/data/lifeseq-sample --synth 200000 --work /tmp/bench-lengths
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.store.lengths import split_lengths
from lifeseq_shards.store.manifest import Manifest
from lifeseq_shards.store.remote import read_manifest
from tools.common import synth_dataset

HEADER = ("| population | split | persons | shard bytes | index bytes | from the index (ms) | decoding the blocks (ms) "
          "| ratio |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def median_seconds(root: Path, m: Manifest, split: str, index: bool, repeats: int) -> tuple[float, np.ndarray]:
    """The median wall time of ``repeats`` reads of the split's lengths (the manifest read before, as the plan has
    it), and the lengths read."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lengths, _ = split_lengths(str(root), m, split, index=index)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), lengths


def rows(name: str, root: Path, repeats: int) -> list[str]:
    """One table row a split of the dataset at ``root``; the two ways must give the same lengths."""
    m = read_manifest(root)
    out = []
    for split, info in m.splits.items():
        assert info.lengths is not None, f"{root}: converted without a lengths index"
        indexed, a = median_seconds(root, m, split, True, repeats)
        decoded, b = median_seconds(root, m, split, False, repeats)
        assert np.array_equal(a, b), f"{root}: split {split}: the index and the blocks disagree"
        shard_bytes = sum(e.bytes for e in info.entries())
        out.append(f"| {name} | {split} | {info.persons:,} | {shard_bytes:,} | {info.lengths.bytes:,} | "
                   f"{indexed * 1e3:.2f} | {decoded * 1e3:.1f} | {decoded / indexed:.0f}x |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="Where the conversions go (reused by a second run).")
    p.add_argument("--sample", type=Path, help="The researchers' sample folder (its encoded_nomlm.h5).")
    p.add_argument("--synth", type=int, nargs="*", default=[], help="Synthetic populations of these many persons.")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print(HEADER)
    if a.sample:
        root = a.work / "sample"
        if not (root / "manifest.json").exists():
            convert_dataset([str(a.sample / "encoded_nomlm.h5")], root, opts=ConvertOptions(progress=False))
        print("\n".join(rows("sample", root, a.repeats)), flush=True)
    for n in a.synth:
        root = synth_dataset(a.work / f"synth-{n}", n, seed=0)
        print("\n".join(rows(f"synth {n:,}", root, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
