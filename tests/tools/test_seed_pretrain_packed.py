"""docs/seed-pretrain.diff's packed option on the researchers' own code (their repository at 884ef02, as
tests/test_performer.py finds it; skipped only where it is absent): their ``TransformerEncoder``, patched, computes
the same MLM and CLS losses (and gradients) on a packed batch with ``packed: 512`` as on the padded batch of the same
persons, and their ``pretrain.py``, patched, trains packed on 2 DDP ranks (a real Lightning Trainer over torchrun,
gloo), is SIGKILLed mid-epoch, resumes exactly and predicts (tools/seed_pretrain_check.py, with --packed)."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, both_layouts, rezero_gains, scaled, their_code, their_repo

from tools.seed_pretrain_check import HPARAMS, their_copy

# what their code imports that the test stacks lack (docs/results/seed-pretrain.md, "DEPS"): their pins on numpy 1
THEIR_DEPS = {1: ["pandas==2.0.3", "polars==1.23.0", "pytz==2023.3", "six==1.16.0"],
              2: ["pandas", "polars", "pytz", "tzdata"]}
CHECK_S = 900  # the check below: data, fit, kill, resume and predict of 200 persons on 2 loaded cores


def needs_their_repo() -> Path:
    repo = their_repo()
    if repo is None:
        pytest.skip("their repository is not here (the fetched mirror, or THEIR_REPO): docs/results/seed-pretrain.md "
                    "has the check's runs")
    return repo


@pytest.fixture(scope="module")
def their_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Their models.py at 884ef02 with docs/seed-pretrain.diff applied, imported from a copy."""
    dest = tmp_path_factory.mktemp("their")
    their_copy(needs_their_repo(), "884ef02", dest, patch=True, paths=("pop2vec/__init__.py", "pop2vec/llm/src"))
    with their_code(dest):
        from pop2vec.llm.src.transformer import models
        assert Path(models.__file__).is_relative_to(dest), models.__file__  # the patched copy, not an earlier one
        yield models


def their_model(models: Any, vocab: int, packed: object) -> Any:
    """Their TransformerEncoder with the check's tiny hparams (dropouts 0), ReZero gains away from their 0 start so
    that attention counts; ``packed`` as the diff's hparams say it (False: padded)."""
    torch.manual_seed(0)
    hparams = yaml.safe_load(HPARAMS.format(vocab_size=vocab, epochs=1, batch_size=12)) | {"packed": packed}
    model = models.TransformerEncoder(hparams)
    rezero_gains(model.transformer)
    return model


def their_losses(model: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Their training_step's two losses (its own loss modules, on what their forward returns)."""
    mlm, cls = model(batch)
    return model.mlm_loss(mlm.permute(0, 2, 1), target=batch["target_tokens"].long()), \
        model.cls_loss(cls, target=batch["target_cls"].long())


def test_their_losses_on_packed_batches_mean_what_they_meant(their_models: Any, mlm_dataset: Path) -> None:
    """The same 12 persons, padded to 512 as before and packed: with ``packed: 512`` the MLM loss (mean over the
    masked tokens) and the CLS loss (over the persons) equal the padded ones to 1e-5, and so do the gradients (1e-4);
    with ``packed: unpadded`` (no padding keys) the losses differ (their global heads no longer count the padding)."""
    padded, flat, vocab = both_layouts(mlm_dataset)
    runs = {}
    for packed, batch in ((False, padded), (512, flat), ("unpadded", flat)):
        model = their_model(their_models, vocab, packed)
        mlm, cls = their_losses(model, batch)
        (0.8 * mlm + 0.2 * cls).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[packed] = (float(mlm.detach()), float(cls.detach()), grads)
    (mlm0, cls0, g0), (mlm1, cls1, g1), (mlm2, cls2, _) = runs[False], runs[512], runs["unpadded"]
    assert abs(mlm1 - mlm0) <= 1e-5 * abs(mlm0) and abs(cls1 - cls0) <= 1e-5 * abs(cls0), (mlm0, mlm1, cls0, cls1)
    assert sorted(g1) == sorted(g0)
    for name, g in g0.items():
        assert float((g1[name] - g).norm()) <= 1e-4 * max(float(g.norm()), 1e-12), name
    assert abs(mlm2 - mlm0) > 1e-4 * abs(mlm0) or abs(cls2 - cls0) > 1e-4 * abs(cls0)


def their_deps(dest: Path) -> Path:
    """A directory with what their code imports that this stack lacks (pip --target, never into the stack), installed
    once per Python, pins and machine in the user's cache (XDG_CACHE_HOME) and reused by later runs instead of
    installed again each run (26-40 s a stack on the 2-core machine at load 8-10). The newest stack's unpinned
    ones stay as their first install found them: remove the folder to take newer. Written beside it, then renamed
    in whole."""
    if all(importlib.util.find_spec(m) for m in ("pandas", "polars")):
        return dest
    pins = THEIR_DEPS[int(np.__version__.split(".")[0])]
    key = f"py{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}-{'-'.join(pins)}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lifeseq-shards" / "their-deps" / key
    if cache.is_dir():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    part = tempfile.mkdtemp(dir=cache.parent, prefix=".partial-")
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", part, *pins],
                       check=True, timeout=scaled(300))
        os.rename(part, cache)
    except OSError:
        if not cache.is_dir():
            raise  # not another run's rename that came first (its copy would be as good)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return cache


@pytest.mark.slow
@pytest.mark.timeout(CHECK_S + 360)
def test_their_pretrain_trains_packed_on_two_ranks_resumes_and_predicts(tmp_path: Path) -> None:
    """Their pretrain.py, patched, with ``packed: 512`` and 1,200-token batches: 2 ranks (torchrun, their
    DDPStrategy over gloo) read every train person once per epoch in the same number of steps, a run SIGKILLed after
    a mid-epoch checkpoint resumes with the same persons, losses and learning rates as the uninterrupted one and the
    same final weights, and predict embeds every person once, recording padding 'packed pad_to=512'."""
    repo = needs_their_repo()
    cmd = [sys.executable, "-m", "tools.seed_pretrain_check", str(repo), "--deps", str(their_deps(tmp_path / "deps")),
           "--work", str(tmp_path / "work"), "--persons", "200", "--batch-size", "8", "--packed", "512",
           "--tokens-per-batch", "1200", "--resume", "steps", "--timeout", str(scaled(CHECK_S / 3))]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=scaled(CHECK_S), check=False)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    for step in ("apply", "data", "fit", "kill", "resume (every_n_train_steps checkpoint)", "predict"):
        assert any(line.startswith(f"PASS {step}:") for line in lines), (step, out.stdout)
    assert any("padding 'packed pad_to=512'" in line for line in lines), out.stdout
