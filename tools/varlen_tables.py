"""docs/results/training-gpu.md's padding-free tables from one tools/device_check.sh run: the padding-free
step's bars (met or not), the sweep's points, attention per head layout and the batch preparation, as
markdown on stdout.

Usage: python -m tools.varlen_tables DIR   (DIR holds results.csv and, when measured, attn.csv and prep.csv)
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path


def _read(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _num(v: str | None) -> float:
    try:
        return float(v) if v not in (None, "") else math.nan
    except ValueError:
        return math.nan


def _fmt(v: float, digits: int = 3) -> str:
    if math.isnan(v):
        return "—"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def _variant(r: dict[str, str]) -> tuple[str, str]:
    """The host-cost levers beyond the first run's axes (absent from its results.csv: their defaults)."""
    return r.get("masker") or "eager", r.get("prefetch_thread") or "False"


def _label(r: dict[str, str]) -> str:
    masker, thread = _variant(r)
    words = [r["attention"], "prefetch" if r["prefetch"] == "True" else "", "in a thread" if thread == "True" else "",
             "compiled" if r["compile"] == "True" else "eager", f"+ masker {masker}" if masker != "eager" else ""]
    return " ".join(w for w in words if w)


def _point(rows: list[dict[str, str]], size: str, attention: str, prefetch: bool, compile: bool) -> dict[str, float]:
    """The point with these axes and the default host levers (eager masker, no prefetch thread)."""
    for r in rows:
        if (r["size"], r["attention"], r["prefetch"], r["compile"], r["status"], *_variant(r)) == (
                size, attention, str(prefetch), str(compile), "ok", "eager", "False"):
            return {k: _num(v) for k, v in r.items() if k in NUMBERS}
    return {k: math.nan for k in NUMBERS}


def _best_small(rows: list[dict[str, str]]) -> tuple[str, dict[str, float]]:
    """small-tc's fastest padding-free point, whichever levers it uses: both small-tc bars must hold at one point."""
    ok = [r for r in rows if (r["size"], r["attention"], r["status"]) == ("small-tc", "varlen", "ok")]
    if not ok:
        return "none", {k: math.nan for k in NUMBERS}
    best = max(ok, key=lambda r: _num(r["tokens_per_s"]))
    return _label(best), {k: _num(v) for k, v in best.items() if k in NUMBERS}


NUMBERS = ("tokens_per_s", "step_time_s", "data_wait_frac", "device_gap_frac", "peak_mem_mb", "mfu", "mfu_slots",
           "pad_frac")


def bars(rows: list[dict[str, str]]) -> list[str]:
    """Each bar of the padding-free step as (what, measured, target, met) from the sweep's rows."""
    big_pad, big_var = _point(rows, "large-tc", "padded", False, False), _point(rows, "large-tc", "varlen", True, False)
    big_comp = _point(rows, "large-tc", "varlen", True, True)
    small_pad, small_var = _point(rows, "small-tc", "padded", False, False), _point(rows, "small-tc", "varlen", True,
                                                                                      False)
    best_label, best = _best_small(rows)
    checks = [
        ("large-tc varlen eager / padded eager, real tokens/s", big_var["tokens_per_s"] / big_pad["tokens_per_s"],
         ">= 1.8x", lambda v: v >= 1.8),
        ("large-tc varlen eager, real tokens/s", big_var["tokens_per_s"], ">= 730k", lambda v: v >= 730e3),
        ("large-tc varlen compiled, real tokens/s", big_comp["tokens_per_s"], ">= 1M", lambda v: v >= 1e6),
        ("small-tc varlen (prefetch) device_gap_frac", small_var["device_gap_frac"], "< 5 %", lambda v: v < 0.05),
        ("small-tc varlen (prefetch) / padded eager, real tokens/s",
         small_var["tokens_per_s"] / small_pad["tokens_per_s"], ">= 1.5x", lambda v: v >= 1.5),
        (f"small-tc fastest padding-free point ({best_label}) device_gap_frac", best["device_gap_frac"], "< 5 %",
         lambda v: v < 0.05),
        (f"small-tc fastest padding-free point ({best_label}) / padded eager, real tokens/s",
         best["tokens_per_s"] / small_pad["tokens_per_s"], ">= 1.5x", lambda v: v >= 1.5),
        ("large-tc peak memory, varlen / padded", big_var["peak_mem_mb"] / big_pad["peak_mem_mb"], "<= 1",
         lambda v: v <= 1.0),
        ("small-tc peak memory, varlen / padded", small_var["peak_mem_mb"] / small_pad["peak_mem_mb"], "<= 1",
         lambda v: v <= 1.0),
    ]
    out = ["| bar | measured | target | met |", "|---|---|---|---|"]
    for what, value, target, ok in checks:
        met = "—" if math.isnan(value) else "yes" if ok(value) else "NO"
        out.append(f"| {what} | {_fmt(value)} | {target} | {met} |")
    return out


def sweep(rows: list[dict[str, str]]) -> list[str]:
    cols = ("size", "attention", "prefetch", "prefetch_thread", "compile", "masker", "tokens_per_s", "step_time_s",
            "device_gap_frac", "data_wait_frac", "peak_mem_mb", "mfu", "mfu_slots", "pad_frac", "status")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        r = {**r, "masker": _variant(r)[0], "prefetch_thread": _variant(r)[1]}
        cells = [_fmt(_num(r[c])) if c in NUMBERS else r[c] for c in cols]
        if r["status"] != "ok":
            cells[-1] = f"{r['status']}: {r.get('reason', '')[:80]}"
        out.append("| " + " | ".join(cells) + " |")
    return out


def host_phases(rows: list[dict[str, str]]) -> list[str]:
    """Where each point's step goes on the host: between steps (fetching and preparing the next batch) and inside
    the step (train_bench.StepMeter's forward, backward, optimizer), in ms per step; empty before they were measured."""
    measured = [r for r in rows if r["status"] == "ok" and _num(r.get("host_forward_ms")) >= 0]
    if not measured:
        return []
    out = ["| point | step ms | between steps | forward | backward | optimizer | device_gap_frac |",
           "|---|---|---|---|---|---|---|"]
    for r in measured:
        step = _num(r["step_time_s"]) * 1e3
        cells = [step, _num(r["data_wait_frac"]) * step,
                 *(_num(r[f"host_{phase}_ms"]) for phase in ("forward", "backward", "optimizer")),
                 _num(r["device_gap_frac"])]
        out.append(f"| {r['size']} {_label(r)} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return out


def attention(rows: list[dict[str, str]]) -> list[str]:
    out = ["| sizes | heads x dim | padded (SDPA + mask) ms | varlen ms | speed-up | varlen kernel | "
           "varlen TFLOP/s (real pairs) |", "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["what"] for r in rows):
        mine = {r.get("mode", ""): r for r in rows if r["what"] == name}
        pad, var = mine.get("padded", {}), mine.get("varlen", {})
        p_ms, v_ms = _num(pad.get("device_ms")), _num(var.get("device_ms"))
        shape = f"{var.get('heads') or pad.get('heads')} x {var.get('head_dim') or pad.get('head_dim')}"
        err = var.get("error") or pad.get("error") or ""
        kernel = f"{var.get('backend', '')}{' ' + err[:60] if err else ''}"
        out.append(f"| {name} | {shape} | {_fmt(p_ms)} | {_fmt(v_ms)} | {_fmt(p_ms / v_ms)} | {kernel} | "
                   f"{_fmt(_num(var.get('real_pair_tflops')))} |")
    return out


def prep(rows: list[dict[str, str]]) -> list[str]:
    out = ["| what | mode | host ms | device ms | first call s | equal to eager |", "|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("error") or ""
        out.append(f"| {r['what']} | {r['mode']} | {_fmt(_num(r.get('host_ms')))} | {_fmt(_num(r.get('device_ms')))} "
                   f"| {_fmt(_num(r.get('first_call_s')))} | {r.get('equal_to_eager', '')}{err[:80]} |")
    return out


def main(folder: Path) -> str:
    results = _read(folder / "results.csv")
    parts = ["### Bars (the padding-free step)", "", *bars(results), "", "### Sweep (train_bench)", "",
             *sweep(results)]
    if phases := host_phases(results):
        parts += ["", "### Host time per step, by phase (ms)", "", *phases]
    if attn := _read(folder / "attn.csv"):
        parts += ["", "### Attention alone, forward + backward, per head layout", "", *attention(attn)]
    if rows := _read(folder / "prep.csv"):
        parts += ["", "### Batch preparation and masking", "", *prep(rows)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(main(Path(sys.argv[1])))
