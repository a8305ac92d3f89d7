"""One point of tools/seed_bench.py: the researchers' own ``pretrain.py`` (their copy as it is, or patched by
docs/seed-pretrain.diff) run as their ``__main__`` for a few timed steps, one JSON line appended to OUT. Started by
tools/seed_bench.py in a process of its own, with their copy, what it imports and this checkout on PYTHONPATH; not for
use on its own.

    python -m tools.seed_bench_point CONFIG OUT ROW_JSON -- THEIR_ARGS...

What the point changes in their run, and why (nothing in their files changes):
- the Trainer their ``pretrain()`` builds (through the ``Trainer`` name their script imports) gets ``max_steps``, the
  precision asked for (their script fixes ``PRECISION = "32-true"``), no validation and no checkpoints (a timed
  window of training steps only; their ``ModelCheckpoint`` monitors a validation metric), and
  tools/train_bench.py's ``StepMeter`` as its only callback: their logger, worker count, DataLoader or DataModule,
  TF32 setting (``set_float32_matmul_precision("medium")``), model and optimizer stay theirs;
- ``attention`` other than ``performer`` swaps their ``MultiHeadAttention`` for full softmax attention with the same
  qkv / output widths: ``full-padded`` (scaled_dot_product_attention over the padded (B, L) slots with a key mask)
  or ``full-packed`` (the real tokens only, per person: the reference encoder's ``varlen_attention``, or xformers'
  block-diagonal attention where torch has no varlen kernel and xformers is importable);
- modules their code imports at the top but the training path never uses (``tkinter``, ``turtle``, ``polars``)
  stand in as empty modules where the interpreter lacks them (a GPU image without Tk, no polars wheel carried).
"""

from __future__ import annotations

import importlib.util
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from lifeseq_shards.encoder import Packed, varlen_attention, varlen_backend
from tools.meter import StepMeter, peak_memory_mb, reset_peak_memory

UNUSED_IMPORTS = ("tkinter", "turtle", "polars")


class Meter(StepMeter, pl.Callback):
    """train_bench's StepMeter, as a ``pytorch_lightning`` callback (their Trainer takes only those)."""


def stub_missing(where: Path, names: tuple[str, ...] = UNUSED_IMPORTS) -> list[str]:
    """An empty module file in ``where`` for each of ``names`` the interpreter lacks (any attribute of it is None),
    ``where`` last on sys.path: files, because the shards' loader workers start from a forkserver, which imports
    their script again with this sys.path. Returns the names stubbed."""
    stubbed = [name for name in names if importlib.util.find_spec(name) is None]
    where.mkdir(parents=True, exist_ok=True)
    for name in stubbed:  # `from tkinter import Scrollbar` gets None
        (where / f"{name}.py").write_text("def __getattr__(name):\n    return None\n")
    sys.path.append(str(where))
    return stubbed


def xformers_block_diagonal() -> Any:
    """xformers' memory-efficient attention and its BlockDiagonalMask, or None where xformers does not import."""
    try:
        from xformers.ops import fmha
    except ImportError:
        return None
    return fmha


class FullAttention(nn.Module):
    """Their ``MultiHeadAttention``'s interface (``forward(x, mask)``, x (B, L, hidden), mask (B, L) with the real
    tokens first) with full softmax attention: padded over all L slots, or packed over each person's real tokens."""

    def __init__(self, hparams: Any, kernel: str) -> None:
        super().__init__()
        self.heads, self.packed = hparams.n_heads, kernel != "sdpa-masked"
        self.qkv = nn.Linear(hparams.hidden_size, 3 * hparams.hidden_size, bias=False)  # their qkv_bias=False
        self.out = nn.Linear(hparams.hidden_size, hparams.hidden_size)  # their attn_out_bias=True
        self.fmha = xformers_block_diagonal() if kernel == "xformers-block-diagonal" else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, h = x.shape
        real = mask.bool()
        if not self.packed:
            q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, h // self.heads)).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
            return self.out(a.transpose(1, 2).reshape(b, n, h))
        rows = real.flatten().nonzero().squeeze(1)  # the real tokens, person after person
        lengths = real.sum(1)
        qkv = self.qkv(x.flatten(0, 1)[rows]).unflatten(-1, (3, self.heads, h // self.heads))
        if self.fmha is not None and qkv.is_cuda:
            bias = self.fmha.BlockDiagonalMask.from_seqlens(lengths.tolist())  # a host sync: their step syncs anyway
            a = self.fmha.memory_efficient_attention(*(t[None] for t in qkv.unbind(1)), attn_bias=bias)[0]
        else:
            cu = F.pad(lengths.cumsum(0), (1, 0)).int()
            a = varlen_attention(*qkv.unbind(1), Packed(cu, n))
        out = x.new_zeros(b * n, h)
        out[rows] = self.out(a.flatten(1)).to(out.dtype)
        return out.view(b, n, h)

    def redraw_projection_matrix(self, *args: Any) -> None:
        """Nothing to redraw (their epoch end asks every layer's attention)."""


def varlen_backend_name(dtype: torch.dtype) -> str:
    """What :func:`varlen_attention` runs on CUDA in ``dtype`` here (``flash-varlen`` needs torch >= 2.10)."""
    if not torch.cuda.is_available():
        return "padded-sdpa"
    return varlen_backend(torch.empty(1, 1, 64, dtype=dtype, device="cuda"))


def attention_kernel(kind: str, precision: str) -> str:
    """The kernel ``kind`` runs at ``precision`` here: ``sdpa-masked`` (padded), else the packed path's
    ``flash-varlen`` (CUDA, bf16, torch >= 2.10), ``xformers-block-diagonal`` (CUDA, xformers importable) or
    ``padded-sdpa`` (each person padded around SDPA: the fallback, no cheaper than the padded path)."""
    if kind == "full-padded":
        return "sdpa-masked"
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    if varlen_backend_name(dtype) == "flash-varlen":
        return "flash-varlen"
    return "xformers-block-diagonal" if torch.cuda.is_available() and xformers_block_diagonal() else "padded-sdpa"


def swap_attention(kind: str, precision: str) -> str:
    """Their encoder layers build ``FullAttention`` instead of their performer; returns its kernel (for the row)."""
    from pop2vec.llm.src.transformer import transformer_utils

    kernel = attention_kernel(kind, precision)
    transformer_utils.MultiHeadAttention = lambda hparams: FullAttention(hparams, kernel)
    return kernel


def run(config: str, out: str, row: dict[str, Any], their_args: list[str]) -> None:
    stubbed = stub_missing(Path(config).parent / "stubs")
    attention, precision = row["attention"], row["precision"]
    kernel = swap_attention(attention, precision) if attention != "performer" else "performer"
    meter = Meter(row["warmup"])
    overrides = {"max_steps": row["steps"], "precision": row["precision"], "limit_val_batches": 0,
                 "num_sanity_val_steps": 0, "enable_checkpointing": False, "enable_progress_bar": False,
                 "enable_model_summary": False}

    class Trainer(pl.Trainer):
        def __init__(self, *args: Any, callbacks: list[Any] | None = None, **kw: Any) -> None:
            super().__init__(*args, **{**kw, **overrides, "callbacks": [meter]})

    pl.Trainer = Trainer  # type: ignore[misc]  # their `from pytorch_lightning import Trainer` takes this one
    device = torch.device("cuda" if "gpu" in their_args else "cpu")
    reset_peak_memory(device)
    script = importlib.util.find_spec("pop2vec.llm.src.new_code.pretrain").origin
    sys.argv = [script, *their_args, "--config", config]
    t = time.perf_counter()
    runpy.run_path(script, run_name="__main__")
    if not meter.totals:
        raise RuntimeError(f"the run ended after {meter.steps} measured steps: more persons, or fewer steps")
    elapsed = meter.t1 - meter.t0
    row.update(
        status="ok", kernel=kernel, stubbed=",".join(stubbed), torch=torch.__version__, lightning=pl.__version__,
        matmul=torch.get_float32_matmul_precision(), measured_steps=meter.steps,
        step_time_s=elapsed / meter.steps, persons_per_s=meter.samples / elapsed,
        tokens_per_s=meter.totals[0] / elapsed, pad_frac=1 - meter.totals[0] / meter.padded,
        data_wait_frac=meter.wait / elapsed, device_gap_frac=meter.device_gap / elapsed,
        peak_mem_mb=peak_memory_mb(device), run_s=time.perf_counter() - t,
    )
    with open(out, "a") as f:  # one line per point, at once: a time limit keeps every finished point
        f.write(json.dumps(row) + "\n")


def main() -> None:
    config, out, row, dashes, *their_args = sys.argv[1:]
    assert dashes == "--", "CONFIG OUT ROW_JSON -- THEIR_ARGS..."
    run(config, out, json.loads(row), their_args)


if __name__ == "__main__":
    main()
