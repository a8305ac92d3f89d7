"""tools/seed_bench.py's parts that need neither the researchers' repository nor a GPU: their HDF5 file written from
synthetic persons converts cleanly and holds the targets their loader reads, the plan pairs every point of the diff's
loader with their own, their hparams file takes the point's sizes, the full-attention swap is the same attention
padded and packed, and tools/device_check.sh's `all` / `seed` / `pinned` modes say what they cannot run. The seed
stage's dry run itself needs their code: it runs where their repository is (THEIR_REPO, or the fetched mirror)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from helpers import scaled

from lifeseq_shards.convert.sources.hdf5 import max_targets
from lifeseq_shards.store.remote import read_manifest
from tools import seed_bench as sb
from tools.seed_bench_point import FullAttention

ROOT = Path(__file__).resolve().parents[2]
MIRROR = Path("/work/.mirror/odissei-lifecourse+life-sequencing-dutch/repo")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("seed-data") / "data-64"
    sb.prepare_data(root, 120, 64, 0)
    return root


def test_their_h5_from_synthetic_persons_converts_and_holds_their_layout(data: Path) -> None:
    with h5py.File(data / "encoded_mlm.h5") as f:
        n = f["input_ids"].shape[0]
        ids, mask, orig = f["input_ids"][:], f["padding_mask"][:], f["original_sequence"][:]
        tpos, ttok, pid = f["target_pos"][:], f["target_tokens"][:], f["sequence_id"][:]
    # the synthesised persons the converter keeps (a few have no event in the time range)
    assert 100 <= n <= 120 and ids.shape == (n, 4, 64) and len(set(pid.tolist())) == n
    slots = max_targets(64)
    assert (tpos[:, slots:] == -1).all() and (ttok[:, slots:] == -1).all()
    used = ~((tpos[:, :slots] == 63) & (ttok[:, :slots] == 0))
    assert used.sum(1).min() >= 1  # every person has targets
    for r in range(n):  # each target: a real position, the original token there, and the input changed or kept
        p = tpos[r, :slots][used[r]]
        assert (p < mask[r].sum()).all()
        assert (orig[r, p] == ttok[r, :slots][used[r]]).all()
    assert (ids[:, 0] != orig).any()  # some targets are masked in the input
    manifest = read_manifest(data / "shards")
    assert manifest.splits["val"].persons == sb.NUM_VAL
    assert manifest.splits["train"].persons + manifest.splits["val"].persons == n


def test_the_plan_pairs_their_loader_with_the_diffs_most_important_first() -> None:
    for kind in ("gpu", "cpu"):
        points = sb.plan(kind, "newest")
        assert len(set(points)) == len(points)
        theirs = {p for p in points if p.loader == "theirs"}
        for p in theirs:  # every point of their loader has its twin on the shards, same model and precision
            assert Point(**{**p.__dict__, "loader": "shards"}) in points
        assert points[0].loader == "theirs" and points[1].loader == "shards"
        assert points[0].precision == "32-true" and points[0].attention == "performer"
        assert {p.attention for p in points} == {"performer", "full-padded", "full-packed"}
    gpu = sb.plan("gpu", "newest")
    assert {p.size for p in gpu} == {"small", "medium", "base"} and {p.max_len for p in gpu} == {512, 1024}
    assert {p.batch_size for p in gpu if p.attention == "performer"} == {64, 256}
    first_bf16 = next(i for i, p in enumerate(gpu) if p.precision == "bf16-mixed")
    assert all(p.precision == "32-true" for p in gpu[:first_bf16])


Point = sb.Point


def test_their_hparams_take_the_points_sizes_and_keep_the_rest() -> None:
    their = 'vocab_size: 11726 #fix later\nbatch_size: 10\nmax_length: 512\nhidden_size: 160\nnorm_type: "rezero"\n'
    p = Point("newest", "theirs", "base", 1024, 64, "32-true", "performer")
    lines = dict(line.split(": ", 1) for line in sb.hparams_text(their, "base", p, 99).splitlines())
    assert lines["vocab_size"] == "99" and lines["batch_size"] == "64" and lines["max_length"] == "1024"
    assert lines["hidden_size"] == "768" and lines["n_encoders"] == "12" and lines["epochs"] == "1"
    assert lines["norm_type"] == '"rezero"'


def test_full_attention_packed_is_the_padded_attention_on_real_tokens() -> None:
    torch.manual_seed(0)
    hp = SimpleNamespace(n_heads=4, hidden_size=32)
    padded, packed = FullAttention(hp, "sdpa-masked"), FullAttention(hp, "padded-sdpa")
    packed.load_state_dict(padded.state_dict())
    lengths = torch.tensor([5, 9, 1])
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    x = torch.randn(3, 9, 32)
    a, b = padded(x, mask), packed(x, mask)
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)
    assert (b[~real] == 0).all()  # padding gets nothing from the packed path
    x2 = x.clone()
    x2[~real] = 100.0  # what sits in the padding changes no real token's output
    torch.testing.assert_close(packed(x2, mask)[real], b[real])


def test_table_gives_after_over_before() -> None:
    p = Point("newest", "theirs", "small", 512, 64, "32-true", "performer").__dict__
    rows = [{**p, "status": "ok", "persons_per_s": 100.0}, {**p, "loader": "shards", "status": "ok",
                                                             "persons_per_s": 250.0}]
    assert sb.table(rows).splitlines()[-1].endswith("| 2.50x |")


def _device_check(mode: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "tools/device_check.sh", mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(120), env={**os.environ, "OUT": str(tmp), "PYTHON": sys.executable, **env})


@pytest.mark.slow
def test_device_check_says_what_it_cannot_run(tmp_path: Path) -> None:
    # the tokens stage runs its sweeps and says how each ended (here: a manifest that is not one, so each fails
    # at once, and nothing is synthesised into the checkout); the whole run goes on to the next stage, which says what
    # it cannot run
    fake = tmp_path / "not-a-dataset"
    fake.mkdir()
    (fake / "manifest.json").write_text("{}")
    r = _device_check("all-cpu", tmp_path, STAGES="tokens pinned", PINNED_PYTHON="/nonexistent/python",
                      WORK=str(tmp_path / "work"), DATA=str(fake), DATA1024=str(fake))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stage tokens:" in r.stdout, r.stdout
    assert re.search(r"sweep exit [1-9]", r.stdout) and re.search(r"base exit [1-9]", r.stdout), r.stdout
    assert not (ROOT / ".devshared" / "bench-data").exists()  # the stage read the data it was given
    assert "pinned: no interpreter /nonexistent/python" in r.stdout
    assert (tmp_path / "stages.tgz").exists() and (tmp_path / "log.txt").exists()
    r = _device_check("seed-cpu", tmp_path / "s", SEED_WORK=str(tmp_path / "none"))
    assert r.returncode == 2 and "tools.seed_bench prepare" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(not Path(os.environ.get("THEIR_REPO", MIRROR)).exists() or not os.environ.get("SEED_DEPS"),
                    reason="needs their repository (THEIR_REPO) and their imports (SEED_DEPS): not in CI")
def test_seed_stage_dry_run(tmp_path: Path) -> None:
    """tools/device_check.sh seed-cpu end to end: both loaders, bf16, both attention swaps, a row each."""
    subprocess.run([sys.executable, "-m", "tools.seed_bench", "prepare", os.environ.get("THEIR_REPO", str(MIRROR)),
                    "--work", str(tmp_path / "work"), "--persons", "300", "--lengths", "64"], cwd=ROOT, check=True)
    (tmp_path / "out").mkdir()
    r = _device_check("seed-cpu", tmp_path / "out", SEED_WORK=str(tmp_path / "work"))
    rows = [json.loads(line) for line in (tmp_path / "out" / "seed.jsonl").read_text().splitlines()]
    assert r.returncode == 0 and len(rows) == len(sb.plan("cpu", "newest")), r.stdout[-3000:]
    assert all(row["status"] == "ok" for row in rows), [row.get("reason") for row in rows]
    assert {row["kernel"] for row in rows} == {"performer", "sdpa-masked", "padded-sdpa"}
    for row in rows:
        assert row["persons_per_s"] > 0 and 0 <= row["data_wait_frac"] < 1 and row["peak_mem_mb"] > 0
    assert np.isfinite([row["tokens_per_s"] for row in rows]).all()
