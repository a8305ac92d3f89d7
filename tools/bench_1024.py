"""What the data path costs at the researchers' 1,024 tokens, measured on the host (no GPU needed): per batch, the
reader's time (the host batch, in this process) and the model batch's build on the CPU device (unpack, pad, MLM
masking: an upper bound of its host share, since on a GPU the arithmetic moves to the device), and the bytes per
person on disk, over the bus (the host batch) and in the model's batch, at L = 512 and 1,024, padded and packed.
Times are this process's CPU time (all its threads; what waiting for a shared machine's cores does not add), the
least of 3 interleaved rounds; ratios 1,024 : 512 are of the same run.

Usage: python -m tools.bench_1024 DATA [--batch-size 50 --batches 20]   (DATA converted with --max-seq-len 1024)
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import click
import torch

from lifeseq_shards.device.batch import ModelBatch
from lifeseq_shards.loop import LifeSeqData
from lifeseq_shards.masking import MaskingConfig
from lifeseq_shards.reader import World
from lifeseq_shards.store.remote import read_manifest

LENGTHS = (512, 1024)
LAYOUTS = ("padded", "packed")
ROUNDS = 3


def nbytes(batch: Any) -> int:
    """The bytes of a host batch (what crosses the bus) or of a model batch (its tensors)."""
    if isinstance(batch, ModelBatch):
        return sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
    return batch.nbytes


def measure(root: str, length: int, layout: str, batch_size: int, batches: int) -> dict[str, float]:
    data = LifeSeqData(root, batch_size, num_workers=0, masking=MaskingConfig(), pad_to=length, layout=layout,
                       world=World(0, 1), device="cpu", prefetch=False)
    loader = data.train().loader  # the host batches, before the device
    t0 = time.process_time()
    host = list(itertools.islice(iter(loader), batches))
    t1 = time.process_time()
    built = [data.builder(b, "cpu", 0) for b in host]
    t2 = time.process_time()
    persons = sum(len(b["person_id"]) for b in built)
    return {"read_ms": (t1 - t0) / len(host) * 1e3, "build_ms": (t2 - t1) / len(host) * 1e3,
            "bus_b": sum(nbytes(b) for b in host) / persons, "model_b": sum(nbytes(b) for b in built) / persons,
            "slots": float(built[0]["target_tokens"].shape[1])}


@click.command()
@click.argument("data", type=click.Path(exists=True))
@click.option("--batch-size", default=50, show_default=True, help="their D3-hparams-large.txt batch")
@click.option("--batches", default=20, show_default=True)
def main(data: str, batch_size: int, batches: int) -> None:
    manifest = read_manifest(data)
    if (cap := (manifest.params or {}).get("max_seq_len")) != 1024:
        raise click.BadParameter(f"{data} was converted with --max-seq-len {cap}: convert with --max-seq-len 1024")
    totals = manifest.totals
    click.echo(f"{data}: {totals.persons:,} persons, {totals.bytes / totals.persons:.0f} bytes per person on disk, "
               f"{totals.tokens / totals.persons:.0f} tokens per person; batch {batch_size}, {batches} batches")
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for _round in range(ROUNDS):  # interleaved; the fastest round of each (the first one also warms the caches)
        for key in itertools.product(LENGTHS, LAYOUTS):
            r = measure(data, *key, batch_size, batches)
            rows[key] = {k: min(v, rows[key][k]) for k, v in r.items()} if key in rows else r
    click.echo("| L | layout | target slots | reader CPU ms/batch | build CPU ms/batch | bus bytes/person | "
               "model-batch bytes/person |\n| --- | --- | --- | --- | --- | --- | --- |")
    for (n, lay), r in rows.items():
        click.echo(f"| {n} | {lay} | {r['slots']:.0f} | {r['read_ms']:.1f} | {r['build_ms']:.1f} | {r['bus_b']:.0f} "
                   f"| {r['model_b']:.0f} |")
    for lay in LAYOUTS:
        a, b = rows[(512, lay)], rows[(1024, lay)]
        click.echo(f"{lay}: 1,024 : 512 = reader {b['read_ms'] / a['read_ms']:.2f}x, build "
                   f"{b['build_ms'] / a['build_ms']:.2f}x, bus {b['bus_b'] / a['bus_b']:.2f}x, model batch "
                   f"{b['model_b'] / a['model_b']:.2f}x")


if __name__ == "__main__":
    main()
