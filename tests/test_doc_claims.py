"""The numbers docs/guides/tune-gpu.md claims are the ones its results pages measured: the balance of the ranks and
the budget's fill from docs/results/balance.csv (tools/bench_balance.py, on the converter's own shardings), and the
layout to use on torch < 2.10 from docs/results/layouts-torch.csv (tools/train_bench.py on both stacks). Each claim's
text is rebuilt here from the csv; a re-measurement that moves a number fails until the guide says the new one."""

from __future__ import annotations

import csv
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
GUIDE = REPO / "docs" / "guides" / "tune-gpu.md"


def rows(name: str) -> list[dict[str, str]]:
    with (RESULTS / name).open() as fh:
        return list(csv.DictReader(fh))


def guide() -> str:
    return re.sub(r"\s+", " ", GUIDE.read_text())  # the guide's lines wrap anywhere


def span(values: list[float], digits: int) -> str:
    """``lo-hi`` as the guide writes a range, one number when both ends print alike."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def pick(table: list[dict[str, str]], **where: object) -> list[dict[str, str]]:
    return [r for r in table if all(r[k] == str(v) for k, v in where.items())]


def test_the_balance_claimed_is_the_balance_measured() -> None:
    table = rows("balance.csv")
    persons = pick(table, population="sample", plan="persons", batch_persons=50)
    few = [r for r in persons if r["ranks"] in ("2", "4")]
    eight = pick(persons, ranks=8)
    assert few and eight
    claim = (f"{span([float(r['tokens_mean']) for r in few], 2)}x the mean tokens of a step at 50 persons on 2-4 "
             f"ranks (p99 {span([float(r['tokens_p99']) for r in few], 2)}), "
             f"{span([float(r['tokens_mean']) for r in eight], 2)}x on 8 ranks")
    assert claim in guide(), claim
    tokens = pick(table, plan="tokens")
    claim = (f"max/mean {span([float(r['tokens_mean']) for r in tokens], 4)} on average over an epoch's steps (p99 "
             f"{span([float(r['tokens_p99']) for r in tokens], 4)})")
    assert claim in guide(), claim
    headline = pick(tokens, population="sample", ranks=8, batch_persons=50)
    claim = (f"at 8 ranks x 50 persons the sample's p99 is {span([float(r['tokens_p99']) for r in headline], 4)}, "
             "above 1.01")
    assert claim in guide(), claim
    attention = pick(table, plan="attention")
    claim = (f"({span([float(r['len2_mean']) for r in attention], 3)}, p99 <= "
             f"{max(float(r['len2_p99']) for r in attention):.3f}, against "
             f"{span([float(r['len2_mean']) for r in tokens], 3)} for the token balance's)")
    assert claim in guide(), claim


def test_the_fill_claimed_is_the_fill_measured() -> None:
    tokens = pick(rows("balance.csv"), plan="tokens")
    large = [100 * (1 - float(r["fill"])) for r in tokens if r["population"].startswith("synth-")]
    sample = [100 * (1 - float(r["fill"])) for r in tokens if r["population"] == "sample"]
    assert large and sample
    claim = (f"batches hold {min(large):.0f}-{max(large):.0f} % fewer tokens than the budget on populations of "
             f"100,000 persons and more, {min(sample):.0f}-{max(sample):.0f} % on the sample")
    assert claim in guide(), claim


def test_the_layout_advised_on_old_torch_is_the_faster_one_measured() -> None:
    table = rows("layouts-torch.csv")
    ratio = {}
    for version in dict.fromkeys(r["torch"] for r in table):
        step = {r["layout"]: float(r["step_time_s"]) for r in pick(table, torch=version)}
        ratio[version.removesuffix(".0")] = step["packed"] / step["padded"]  # 2.13.0 is torch 2.13
    assert set(ratio) == {"2.1.2", "2.13"}
    assert ratio["2.1.2"] > 1, "the guide advises the padded layout on torch < 2.10: it must be the faster there"
    claim = (f"packed took {ratio['2.1.2']:.2f}x the padded step's time on torch 2.1.2 and {ratio['2.13']:.2f}x on "
             "torch 2.13")
    assert claim in guide(), claim
    assert 'on torch < 2.10 use `layout="padded"`' in guide()
