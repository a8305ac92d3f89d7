"""What the training benches measure around a Lightning step: the step window on the host's and the device's
timelines (:class:`StepMeter`), and peak memory. Shared by tools/train_bench.py and tools/seed_bench_point.py."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

HOST_PHASES = ("forward", "backward", "optimizer")  # StepMeter's split of the host's time inside a step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mark(device: torch.device) -> torch.cuda.Event | float:
    """A point on the device's timeline: a CUDA event on the current stream, or the host clock on CPU (where the
    work is synchronous, so the two timelines are one)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds(a: torch.cuda.Event | float, b: torch.cuda.Event | float) -> float:
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a  # type: ignore[operator]


class StepMeter(Callback):
    """Times steps `warmup`..max_steps-1 and the gaps between them, on the host and on the device, without per-step
    syncs.

    The window opens at the end of step `warmup - 1` and closes at the end of the last step, each after one device
    sync. Host wait = time from a step's on_train_batch_end to the next on_train_batch_start (Lightning fetches and
    moves the next batch in between). Device gap = the same interval on the device's timeline (CUDA events): the
    batch's copy, unpack and masking, and any time the device sat idle waiting for the host. On a GPU the host runs
    ahead and its wait includes time blocked on a full launch queue; only the device gap says whether the GPU
    waited. Token counts stay on the device until the window closes.

    The host's time inside a step is split the same way, by Lightning's hooks: forward (the training step and its
    logging, up to the backward), backward, and optimizer (the optimizer and scheduler steps): what a host-bound
    step spends launching each part (docs/results/training-gpu.md).
    """

    def __init__(self, warmup: int) -> None:
        if warmup < 1:
            raise ValueError("warmup must be >= 1: the window opens at the end of a warm-up step")
        self.warmup = warmup
        self.t0 = self.t1 = self.last_end = math.nan
        self.wait = self.device_gap = 0.0
        self.last_mark: torch.cuda.Event | float | None = None
        self.gaps: list[tuple[torch.cuda.Event | float, torch.cuda.Event | float]] = []
        self.steps = self.samples = self.padded = self.attended = 0  # attended: padded query-key pairs
        self.counts: torch.Tensor | None = None  # real tokens, sum of squared lengths, used MLM targets
        self.totals: list[float] = []
        self.host = dict.fromkeys(HOST_PHASES, 0.0)  # seconds over the measured steps
        self.phase_start: float | None = None  # None outside a measured step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx < self.warmup:
            return
        self.wait += time.perf_counter() - self.last_end
        self.gaps.append((self.last_mark, mark(pl_module.device)))  # before this hook queues its own kernels
        # as the model sees them (cropped to max_len) in both layouts; a batch of the researchers' own loader
        # (tools/seed_bench.py) has no lengths: its padding mask holds them
        lengths = (batch["lengths"] if "lengths" in batch else batch["padding_mask"].sum(1)).long()
        step = torch.stack([lengths.sum(), (lengths * lengths).sum(), (batch["target_tokens"] != 0).sum()])
        self.counts = step if self.counts is None else self.counts + step
        self.steps += 1
        self.samples += batch["target_cls"].shape[0]
        self.padded += batch["input_ids"].numel() // 4  # slots computed: B*L padded, the N real tokens packed
        if "padding_mask" in batch:  # every query slot attends to all L keys
            self.attended += batch["padding_mask"].numel() * batch["padding_mask"].shape[1]
        self.phase_start = time.perf_counter()  # after this hook's own launches

    def _phase_ends(self, phase: str) -> None:
        if self.phase_start is not None:
            now = time.perf_counter()
            self.host[phase] += now - self.phase_start
            self.phase_start = now

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._phase_ends("forward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._phase_ends("backward")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._phase_ends("optimizer")
        self.phase_start = None
        if batch_idx == self.warmup - 1:
            sync(pl_module.device)
            self.t0 = time.perf_counter()
        elif batch_idx == trainer.max_steps - 1 and self.counts is not None:
            sync(pl_module.device)
            self.t1 = time.perf_counter()
            self.device_gap = sum(seconds(a, b) for a, b in self.gaps)
            self.totals = trainer.strategy.reduce(self.counts.double(), reduce_op="sum").tolist()
        self.last_mark = mark(pl_module.device)
        self.last_end = time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) of this process


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan
