"""The parts of a GPU step that the padding-free layout changes, timed one by one on real batches
(tools/device_check.sh runs it):

- ``prep``: a batch's preparation (copy, unpack, masking, and the packing for the padding-free layout) per layout,
  host time to launch it and device time to run it; the masker alone, eager against its eager kernels replayed as
  a CUDA graph (``DynamicMasker(cfg, "graphed")``) and ``torch.compile`` (default, and "reduce-overhead", which replays
  CUDA graphs of inductor's kernels: the shapes are fixed at (B, L)), outputs checked equal to eager ones bit for
  bit; and the packed preparation with ``DynamicMasker(cfg, "graphed")`` and ``DynamicMasker(cfg, "compiled")``.
- ``attn``: one attention forward + backward at the reference model's head layouts (the seed's 10 heads of 16, 28 or
  50 dims, the "-tc" sizes' heads of 64), padded with a key mask (scaled_dot_product_attention) against per person
  (``lifeseq_shards.model.varlen_attention``), on the lengths of real batches.

Usage: python -m tools.bench_kernels DATA --out DIR [--batch-size 256 --max-len 512 --reps 20]
Writes DIR/prep.csv and DIR/attn.csv, each row as soon as it is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F

from lifeseq_shards.device.batch import PackedBatch
from lifeseq_shards.device.build import count_tokens, model_batch, to_device
from lifeseq_shards.device.shape import PACKED, PADDED
from lifeseq_shards.encoder import SIZES, Packed, varlen_attention, varlen_backend
from lifeseq_shards.masking import COMPILED, GRAPHED, DynamicMasker, MaskingConfig
from lifeseq_shards.reader import ShardedDataset
from lifeseq_shards.store.remote import read_manifest
from tools.common import write_csv

# (name, hidden, heads) of every size, narrowest first, so each seed size sits beside its tensor-core twin
HEAD_LAYOUTS = tuple(sorted(((name, cfg.hidden, cfg.heads) for name, cfg in SIZES.items()), key=lambda x: x[1]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[int], Any], reps: int, device: torch.device) -> tuple[float, float]:
    """(host ms, device ms) per call, after 3 warm-up calls: host = launching the calls (no sync in between), device
    = the wall time until the device has run them all (on CPU the two are one)."""
    for i in range(3):
        fn(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i)
    t1 = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    return (t1 - t0) / reps * 1e3, (t2 - t0) / reps * 1e3


def _error(e: Exception) -> str:
    """An exception as a CSV cell: a kernel or compile failure is a result too."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"


class Rows:
    """A CSV written again after every row, so a run stopped by a time limit keeps what it measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        click.echo(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        write_csv(self.path, self.rows)


def host_batches(data: Path, batch_size: int, n: int, pin: bool) -> list[PackedBatch]:
    ds = ShardedDataset(data, split="train", batch_size=batch_size, seed=0, packed=True)
    out = []
    for batch in ds:
        batch = batch.with_buffer(torch.from_numpy(batch.buffer))
        out.append(batch.pin_memory() if pin else batch)
        if len(out) == n:
            break
    return out


def bench_prep(batches: list[dict[str, Any]], masker: DynamicMasker, max_len: int, device: torch.device, reps: int,
               rows: Rows) -> None:
    for layout in (PADDED, PACKED):
        def prep(i: int, layout: str = layout) -> dict[str, Any]:
            host = count_tokens(batches[i % len(batches)], max_len)
            return model_batch(to_device(host, device), masker, epoch=0, layout=layout, max_len=max_len)

        host_ms, device_ms = timed(prep, reps, device)
        rows.add(part="prep", what=f"copy+unpack+mask ({layout})", mode="eager", host_ms=host_ms, device_ms=device_ms)

    what = f"copy+unpack+mask ({PACKED})"
    for mode in (GRAPHED, COMPILED):
        fast = DynamicMasker(masker.cfg, mode)  # what train_bench's masker=graphed / compiled runs in the step

        def prep_fast(i: int, fast: DynamicMasker = fast) -> dict[str, Any]:
            host = count_tokens(batches[i % len(batches)], max_len)
            return model_batch(to_device(host, device), fast, epoch=0, layout=PACKED, max_len=max_len)

        try:
            host_ms, device_ms = timed(prep_fast, reps, device)
            rows.add(part="prep", what=what, mode=f"masker {mode}", host_ms=host_ms, device_ms=device_ms)
        except Exception as e:
            rows.add(part="prep", what=what, mode=f"masker {mode}", error=_error(e))

    padded = [model_batch(to_device(count_tokens(b, max_len), device), None, max_len=max_len) for b in batches]
    args = [(b["input_ids"][:, 0], *b["input_ids"][:, 1:].unbind(1), b["lengths"], b["person_id"]) for b in padded]
    eager = masker.draw
    launchers = {"eager": eager, "graphed": DynamicMasker(masker.cfg, GRAPHED),
                 **{mode: torch.compile(eager, mode=mode, dynamic=False) for mode in ("default", "reduce-overhead")}}
    for mode, fn in launchers.items():
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            t0 = time.perf_counter()
            first = fn(*args[0], 0)
            _sync(device)
            compile_s = time.perf_counter() - t0
            want = eager(*args[0], 0)
            same = all(torch.equal(first[k], want[k]) for k in want)
            host_ms, device_ms = timed(lambda i, fn=fn: fn(*args[i % len(args)], 0), reps, device)
            rows.add(part="prep", what="masker", mode=mode, host_ms=host_ms, device_ms=device_ms,
                     first_call_s=compile_s, equal_to_eager=same,
                     graphs_compiled=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
        except Exception as e:  # a compile failure is a result too
            rows.add(part="prep", what="masker", mode=mode, error=_error(e))


def attention_pair(lengths: torch.Tensor, max_len: int, heads: int, d: int, dtype: torch.dtype):
    """Forward + backward of one attention call on the same persons, padded with a key mask and per person."""
    device, B, n = lengths.device, len(lengths), int(lengths.sum())
    packed = Packed(F.pad(torch.cumsum(lengths, 0), (1, 0)).int(), max_len)
    real = torch.arange(max_len, device=device) < lengths[:, None]
    g = torch.Generator(device=device).manual_seed(0)
    qkv_packed = torch.randn(3, n, heads, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    qkv_padded = torch.randn(3, B, heads, max_len, d, device=device, dtype=dtype, generator=g, requires_grad=True)

    def varlen(_i: int) -> None:
        varlen_attention(*qkv_packed, packed).sum().backward()

    def padded(_i: int) -> None:
        F.scaled_dot_product_attention(*qkv_padded, attn_mask=real[:, None, None, :]).sum().backward()

    return padded, varlen, varlen_backend(qkv_packed[0])


def bench_attention(batches: list[dict[str, Any]], max_len: int, device: torch.device, dtype: torch.dtype,
                    reps: int, rows: Rows) -> None:
    first = model_batch(to_device(count_tokens(batches[0], max_len), device), None, max_len=max_len)
    lengths = first["lengths"].long()
    pairs = float((lengths * lengths).sum())
    for name, hidden, heads in HEAD_LAYOUTS:
        d = hidden // heads
        try:
            padded, varlen, backend = attention_pair(lengths, max_len, heads, d, dtype)
        except Exception as e:
            rows.add(part="attn", what=name, error=_error(e))
            continue
        for mode, fn, kernel in (("padded", padded, "sdpa+mask"), ("varlen", varlen, backend)):
            try:
                host_ms, device_ms = timed(fn, reps, device)
                # forward + backward = 3x the forward's 2 matmuls of 2*d FLOPs per (query, key) pair and head
                tflops = 3 * 4 * pairs * d * heads / (device_ms / 1e3) / 1e12
                rows.add(part="attn", what=name, mode=mode, backend=kernel, heads=heads, head_dim=d,
                         host_ms=host_ms, device_ms=device_ms, real_pair_tflops=tflops,
                         mean_len=float(lengths.float().mean()), max_len=max_len)
            except Exception as e:
                rows.add(part="attn", what=name, mode=mode, backend=kernel, heads=heads, head_dim=d,
                         error=_error(e))


@click.command()
@click.argument("data", type=click.Path(path_type=Path, exists=True))
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--batch-size", type=int, default=256, show_default=True)
@click.option("--max-len", type=int, default=512, show_default=True)
@click.option("--reps", type=int, default=20, show_default=True)
@click.option("--parts", default="attn,prep", show_default=True, help="comma list, run in this order")
def main(data: Path, out: Path, batch_size: int, max_len: int, reps: int, parts: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    vocab = int(read_manifest(data).vocab_size)
    batches = host_batches(data, batch_size, 4, pin=device.type == "cuda")
    masker = DynamicMasker(MaskingConfig(vocab_size=vocab, seed=0))
    for part in parts.split(","):  # in the order given
        if part == "prep":
            bench_prep(batches, masker, max_len, device, reps, Rows(out / "prep.csv"))
        elif part == "attn":
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            bench_attention(batches, max_len, device, dtype, reps, Rows(out / "attn.csv"))
        else:
            raise click.BadParameter(f"unknown part {part!r}")
    click.echo(f"done: {out}")


if __name__ == "__main__":
    main()
