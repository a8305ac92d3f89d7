"""docs/port-pretrain.diff against the researchers' own file: its header names the file it was made against (their
repository, path and commit, its sha256; the index line its git blob), the diff applies to that file, and their loop
as patched trains data-parallel under torchrun: after each validation both ranks hold the same weights (DDP averaged
the gradients), and an early stop decided on rank 0 ends every rank at the same step. With hparams ``packed`` it
trains their model's structure (the stub's performer stand-in) on packed, token-balanced batches: at ``packed: 512``
its MLM and CLS losses and embeddings are the padded ones, at ``unpadded`` they differ, and the embeddings it writes
record the mode.

Their file is not part of this repository (their code stays theirs): the tests that need it read it from
``$LIFESEQ_PORT_PRETRAIN``, else from ../shared/life-sequencing-dutch/<its path> beside the clone, and are skipped
without it. The diff's header says where to get it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_harness import SCRIPTS, TORCHRUN, launch
from doc_checks import check_diff_base, diff_base
from helpers import REPO, both_layouts, rezero_gains, shardify, their_code

from lifeseq_shards.embed.spec import Padding

DIFF = REPO / "docs" / "port-pretrain.diff"
STUB = SCRIPTS / "port_stub"
TARGET, _, _ = diff_base(DIFF)
THEIR_FILE = Path(os.environ.get("LIFESEQ_PORT_PRETRAIN", REPO.parent / "shared" / "life-sequencing-dutch" / TARGET))
needs_their_file = pytest.mark.skipif(not THEIR_FILE.is_file(), reason=f"{THEIR_FILE}: their file is not here "
                                      "(set LIFESEQ_PORT_PRETRAIN; docs/port-pretrain.diff says where to get it)")
VAL_EVERY = 4
RUN_S = 480  # one launch; the resumed one trains about 160 batches in one process (2.5 min on 2 loaded cores)


def test_the_diff_names_the_file_it_was_made_against() -> None:
    """Repository, path and full commit in the header, the sha256 of the file, and the guide says where it is."""
    header = DIFF.read_text().split("\ndiff --git", 1)[0]
    commit = re.search(r"life-sequencing-dutch/blob/([0-9a-f]{40})/(\S+)", header)
    assert commit and commit.group(2) == TARGET and commit.group(1) in header.replace("\n", " ")
    guide = (REPO / "docs" / "guides" / "train-plain-loop.md").read_text()
    assert commit.group(1)[:7] in guide and "base-sha256" in guide


def test_a_file_or_a_diff_that_does_not_match_is_refused(tmp_path: Path) -> None:
    """The check fails on another file than the recorded one, and on a diff whose context is not in the file."""
    base = tmp_path / "theirs.py"
    base.write_text("a = 1\nb = 2\nc = 3\n")
    blob = subprocess.run(["git", "hash-object", str(base)], capture_output=True, text=True, check=True).stdout
    sha = hashlib.sha256(base.read_bytes()).hexdigest()

    def diff(context: str) -> Path:
        path = tmp_path / "x.diff"
        path.write_text(f"base-sha256: {sha}\n\ndiff --git a/pkg/x.py b/pkg/x.py\nindex {blob[:7]}..1234567 100644\n"
                        f"--- a/pkg/x.py\n+++ b/pkg/x.py\n@@ -1,3 +1,3 @@\n a = 1\n-{context}\n+b = 4\n c = 3\n")
        return path

    assert check_diff_base(diff("b = 2"), base, tmp_path / "ok").read_text() == "a = 1\nb = 4\nc = 3\n"
    with pytest.raises(AssertionError, match="git apply --check"):
        check_diff_base(diff("b = 5"), base, tmp_path / "context")
    other = tmp_path / "other.py"
    other.write_text("a = 1\nb = 2\nc = 3\n\n")
    with pytest.raises(AssertionError, match="sha256"):
        check_diff_base(diff("b = 2"), other, tmp_path / "other")


@needs_their_file
def test_the_diff_applies_to_their_file(tmp_path: Path) -> None:
    patched = check_diff_base(DIFF, THEIR_FILE, tmp_path)
    compile(patched.read_text(), str(patched), "exec")


def patched_tree(tree: Path) -> Path:
    """Their file, patched, beside the stub's stand-ins for what it imports."""
    check_diff_base(DIFF, THEIR_FILE, tree)
    shutil.copytree(STUB, tree, dirs_exist_ok=True)
    return tree


def their_loop(tree: Path, data: Path, sample: Path, out: Path, ranks: int, *extra: str,
               resume: Path | None = None, val_every: float = VAL_EVERY, **hparams: object) -> list[str]:
    """Their patched ``pretrain.py`` under torchrun on ``ranks`` CPU ranks (gloo), with its JSON config, validating
    every ``val_every`` batches (< 1: that share of an epoch); ``hparams`` added to the file's."""
    (out / "ckpt").mkdir(parents=True)  # their CSV headers are written before their Checkpointer makes it
    hparams = {"seed": 0, "learning_rate": 1e-3, "epochs": 2, "batch_size": 64, "max_length": 512, **hparams}
    (out / "hparams.json").write_text(json.dumps(hparams))
    config = {"HPARAMS_PATH": str(out / "hparams.json"), "VOCAB_PATH": str(sample / "vocab.csv"),
              "SHARDS_PATH": str(data), "CHECKPOINT_DIR": str(out / "ckpt")}
    if resume:
        config["RESUME_FROM_CHECKPOINT"] = str(resume)
    (out / "config.json").write_text(json.dumps(config))
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", str(tree / TARGET), "--accelerator", "cpu",
            "--ddpstrategy", "gloo", "--config", str(out / "config.json"), "--val_check_interval", str(val_every),
            "--save_last", *extra]


def reports(out: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(ranks)]


@pytest.mark.slow
@needs_their_file
@pytest.mark.timeout(2 * RUN_S + 120)
def test_their_patched_loop_trains_one_model_and_stops_together(ds8: Path, sample: Path,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Their loop, patched, on 2 ranks with an early stop at its second validation (no improvement of 1,000 is
    ever made): every validation finds both ranks' weights equal and changed since the last, and both ranks end
    the epoch at the step rank 0 stopped at. Its checkpoint, saved on 2 ranks, then resumes on 1: the restored
    OneCycleLR refitted to 1 rank's steps, the run ends (a schedule sized for 2 ranks stops it with 'Tried to
    step')."""
    tree = patched_tree(tmp_path / "theirs")
    # their file imports its package by name; the stand-in model imports plain_loop
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tree), str(SCRIPTS)]))
    out = tmp_path / "two"
    monkeypatch.setenv("PORT_OUT", str(out))
    stop = ["--early_stop", "--early_patience", "1", "--early_min_delta", "1000"]
    launch([their_loop(tree, ds8, sample, out, 2, *stop)], tmp_path / "two-logs", RUN_S)
    ranks = reports(out, 2)
    vals = [[(r["step"], r["weights"]) for r in rank if r["event"] == "val"] for rank in ranks]
    assert vals[0] == vals[1], f"the ranks trained different weights: {vals}"
    assert [step for step, _ in vals[0]] == [VAL_EVERY, 2 * VAL_EVERY, 2 * VAL_EVERY], vals[0]  # + the epoch's end
    assert vals[0][0][1] != vals[0][1][1], "no training between the validations"
    ends = [[r["step"] for r in rank if r["event"] == "epoch_end"] for rank in ranks]
    assert ends == [[2 * VAL_EVERY], [2 * VAL_EVERY]], f"the ranks stopped apart: {ends}"

    resumed = tmp_path / "one"
    monkeypatch.setenv("PORT_OUT", str(resumed))
    launch([their_loop(tree, ds8, sample, resumed, 1, resume=out / "ckpt" / "last.ckpt", val_every=0.5)],
           tmp_path / "one-logs", RUN_S)
    epoch_ends = [r["step"] for r in reports(resumed, 1)[0] if r["event"] == "epoch_end"]
    assert len(epoch_ends) == 2, epoch_ends  # the rest of epoch 0, then epoch 1


# ---- the packed option (hparams `packed`, `tokens_per_batch`), on the stub's performer stand-in ----

PERFORMER = {"seed": 0, "learning_rate": 1e-3, "epochs": 1, "steps_per_epoch": 10, "max_length": 512,
             "hidden_size": 40}  # tools/their_encoder.py's tiny size


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Their ``pretrain.py`` as patched, imported from a copy beside the stub (its performer stand-in)."""
    if not THEIR_FILE.is_file():
        pytest.skip(f"{THEIR_FILE}: their file is not here (set LIFESEQ_PORT_PRETRAIN)")
    tree = patched_tree(tmp_path_factory.mktemp("port"))
    with pytest.MonkeyPatch.context() as mp, their_code(tree):
        mp.setenv("PORT_MODEL", "performer")
        mp.syspath_prepend(str(SCRIPTS))  # the stub's tiny stand-in imports plain_loop
        from pop2vec.llm.src.new_code.pytorch_port import pretrain
        assert Path(pretrain.__file__).is_relative_to(tree), pretrain.__file__
        yield pretrain


def port_model(port: Any, vocab: int, packed: object) -> Any:
    """The patched loop's model with ``packed`` as hparams say it (absent: padded), ReZero gains away from their 0
    start so that attention counts."""
    hparams = {**PERFORMER, "vocab_size": vocab} | ({} if packed is None else {"packed": packed})
    model = port._Encoder(hparams)
    rezero_gains(model.transformer)
    return model


def test_the_patched_loop_on_packed_batches_means_what_it_meant(port: Any, mlm_dataset: Path) -> None:
    """The same 12 persons, padded to 512 as before (no ``packed``) and packed: with ``packed: 512`` the
    training_step's losses (MLM: the mean over the masked tokens; CLS: over the persons) and predict_step's
    embeddings equal the padded ones to 1e-5, the gradients to 1e-3; with ``packed: unpadded`` (no padding keys)
    losses and embeddings differ. Each mode names itself as the embedding files record it."""
    padded, flat, vocab = both_layouts(mlm_dataset)
    runs = {}
    for packed, batch in ((None, padded), (512, flat), ("unpadded", flat)):
        model = port_model(port, vocab, packed)
        _, mlm, cls = model.training_step(batch)
        (0.8 * mlm + 0.2 * cls).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            emb = model.predict_step(batch)
        assert torch.equal(emb["sequence_id"], batch["person_id"])
        runs[packed] = (float(mlm.detach()), float(cls.detach()), grads, emb, model.embedding_padding())
    (mlm0, cls0, g0, e0, p0), (mlm1, cls1, g1, e1, p1), (mlm2, cls2, _, e2, p2) = runs.values()
    assert abs(mlm1 - mlm0) <= 1e-5 * abs(mlm0) and abs(cls1 - cls0) <= 1e-5 * abs(cls0), (mlm0, mlm1, cls0, cls1)
    assert len(g0) > 10 and sorted(g1) == sorted(g0)
    # 1e-3, not the issue's 1e-4: through this stand-in's wider dims the global heads' to_q / to_k gradients differ
    # by up to 2.3e-4 relative in fp32 (the rest <= 7e-5); at test_performer's tiny dims float64 agrees to 1e-15, so
    # it is rounding; tests/test_performer.py holds PackedPerformer to 1e-4 at pad_to 128 and 512
    for name, g in g0.items():
        assert float((g1[name] - g).norm()) <= 1e-3 * max(float(g.norm()), 1e-12), name
    for key in ("cls_emb", "mean_emb"):
        assert float((e1[key] - e0[key]).norm()) <= 1e-5 * float(e0[key].norm()), key
    assert abs(mlm2 - mlm0) > 1e-4 * abs(mlm0) or abs(cls2 - cls0) > 1e-4 * abs(cls0), (mlm0, mlm2, cls0, cls2)
    assert float((e2["mean_emb"] - e0["mean_emb"]).norm()) > 1e-4 * float(e0["mean_emb"].norm())
    assert (p0, p1, p2) == ("padded pad_to=512", "packed pad_to=512", "packed unpadded")
    assert all(Padding.parse(p) for p in (p0, p1, p2))  # what EmbeddingWriter(padding=...) takes


@pytest.mark.slow
@needs_their_file
@pytest.mark.timeout(RUN_S + 120)
def test_their_patched_loop_trains_packed_on_two_ranks_and_embeds(ds8: Path, sample: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Their loop, patched, with ``packed: 512`` and 8,192-token batches on 2 ranks (the stub's performer
    stand-in): every validation finds both ranks' weights equal and changed since the last, both ranks end the
    epoch at the same step, and ``--embed_dir`` embeds every person once, its files recording 'packed pad_to=512'
    (``shardify embeddings verify`` passes)."""
    tree = patched_tree(tmp_path / "theirs")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tree), str(SCRIPTS)]))
    monkeypatch.setenv("PORT_MODEL", "performer")
    out = tmp_path / "run"
    monkeypatch.setenv("PORT_OUT", str(out))
    emb = tmp_path / "emb"
    launch([their_loop(tree, ds8, sample, out, 2, "--embed_dir", str(emb), val_every=0.5, epochs=1,
                       packed=512, tokens_per_batch=8192, hidden_size=40)], tmp_path / "logs", RUN_S)
    ranks = reports(out, 2)
    vals = [[(r["step"], r["weights"]) for r in rank if r["event"] == "val"] for rank in ranks]
    assert vals[0] == vals[1], f"the ranks trained different weights: {vals}"
    ends = [[r["step"] for r in rank if r["event"] == "epoch_end"] for rank in ranks]
    assert ends[0] == ends[1] and len(ends[0]) == 1, ends
    # every half epoch (the last at its end, when the half divides it), then the epoch's own validation
    assert [step for step, _ in vals[0]][::len(vals[0]) - 1] == [ends[0][0] // 2, ends[0][0]], (vals[0], ends)
    assert vals[0][0][1] != vals[0][-1][1], "no training between the validations"
    assert json.loads((emb / "_embeddings.json").read_text())["padding"] == "packed pad_to=512"
    code, text = shardify("embeddings", "verify", str(emb), "--data", str(ds8))
    assert code == 0, text
