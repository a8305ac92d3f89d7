"""What the host dispatches per training step, phase by phase, on any device: the count of top-level aten ops (each
one or more kernel launches on CUDA) and the host time per phase at tiny shapes, where the arithmetic is negligible
and what is left is dispatch and Python. A CPU-only machine cannot time CUDA, but a host-bound GPU step costs
roughly (ops launched) x (host cost per op), and both of those are counted here (docs/results/training-gpu.md,
issue 13).

Usage: python -m tools.host_ops DATA [--size small-tc --batch-size 16 --max-len 64 --reps 20]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
import torch

from lifeseq_shards.device.build import PACKED, PADDED, count_tokens, model_batch, to_device
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import LifeSeqEncoder, pretrain_losses, resolve_size
from lifeseq_shards.reader import ShardedDataset
from lifeseq_shards.store.remote import read_manifest


def top_level_ops(fn: Callable[[], Any]) -> int:
    """aten ops called by ``fn`` that no other aten op called: what the host dispatches itself."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


def host_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


@click.command()
@click.argument("data")
@click.option("--size", default="small-tc", show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=64, show_default=True)
@click.option("--reps", type=int, default=20, show_default=True)
def main(data: str, size: str, batch_size: int, max_len: int, reps: int) -> None:
    torch.manual_seed(0)
    vocab = int(read_manifest(data).vocab_size)
    host = count_tokens(next(iter(ShardedDataset(data, "train", batch_size, seed=0, packed=True))), max_len)
    masker = DynamicMasker(MaskingConfig(vocab_size=vocab, seed=0))
    cpu = torch.device("cpu")
    rows: list[tuple[str, Callable[[], Any]]] = []
    padded = model_batch(to_device(host, cpu), None, max_len=max_len)
    args = (padded["input_ids"][:, 0], *padded["input_ids"][:, 1:].unbind(1), padded["lengths"], padded["person_id"])
    rows.append(("masker", lambda: masker(*args, 0)))
    for layout in (PADDED, PACKED):
        rows.append((f"prep {layout} (copy+unpack+mask)",
                     lambda layout=layout: model_batch(to_device(host, cpu), masker, layout=layout, max_len=max_len)))
    model = LifeSeqEncoder(resolve_size(size), vocab, dropout=0.0)
    for layout in (PADDED, PACKED):
        batch = model_batch(to_device(host, cpu), masker, layout=layout, max_len=max_len)

        def step(batch: dict[str, Any] = batch) -> None:
            mlm, cls = pretrain_losses(model, batch)
            (mlm + cls).backward()

        rows.append((f"forward+backward {layout}", step))
    for name, kwargs in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
        rows.append((f"AdamW {name} ({len(list(model.parameters()))} tensors)", opt.step))
    click.echo(f"| phase | top-level aten ops | host ms ({size}, batch {batch_size}, L={max_len}) |\n|---|---|---|")
    for name, fn in rows:
        click.echo(f"| {name} | {top_level_ops(fn)} | {host_ms(fn, reps):.2f} |")


if __name__ == "__main__":
    main()
