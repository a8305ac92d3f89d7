"""docs/port-pretrain.diff against the researchers' own file: its header names the file it was made against (their
repository, path and commit, its sha256; the index line its git blob), the diff applies to that file, and their loop
as patched trains data-parallel under torchrun: after each validation both ranks hold the same weights (DDP averaged
the gradients), and an early stop decided on rank 0 ends every rank at the same step.

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
from pathlib import Path

import pytest
from ddp_harness import SCRIPTS, TORCHRUN, launch
from doc_checks import check_diff_base, diff_base
from helpers import REPO

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


def their_loop(tree: Path, data: Path, sample: Path, out: Path, ranks: int, *extra: str,
               resume: Path | None = None, val_every: float = VAL_EVERY) -> list[str]:
    """Their patched ``pretrain.py`` under torchrun on ``ranks`` CPU ranks (gloo), with its JSON config, validating
    every ``val_every`` batches (< 1: that share of an epoch)."""
    (out / "ckpt").mkdir(parents=True)  # their CSV headers are written before their Checkpointer makes it
    hparams = {"seed": 0, "learning_rate": 1e-3, "epochs": 2, "batch_size": 64, "max_length": 512}
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
def test_their_patched_loop_trains_one_model_and_stops_together(vocab_ds8: Path, sample: Path,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Their loop, patched, on 2 ranks with an early stop at its second validation (no improvement of 1,000 is
    ever made): every validation finds both ranks' weights equal and changed since the last, and both ranks end
    the epoch at the step rank 0 stopped at. Its checkpoint, saved on 2 ranks, then resumes on 1: the restored
    OneCycleLR refitted to 1 rank's steps, the run ends (a schedule sized for 2 ranks stops it with 'Tried to
    step')."""
    tree = tmp_path / "theirs"
    check_diff_base(DIFF, THEIR_FILE, tree)
    shutil.copytree(STUB, tree, dirs_exist_ok=True)
    # their file imports its package by name; the stand-in model imports plain_loop
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tree), str(SCRIPTS)]))
    out = tmp_path / "two"
    monkeypatch.setenv("PORT_OUT", str(out))
    stop = ["--early_stop", "--early_patience", "1", "--early_min_delta", "1000"]
    launch([their_loop(tree, vocab_ds8, sample, out, 2, *stop)], tmp_path / "two-logs", RUN_S)
    ranks = reports(out, 2)
    vals = [[(r["step"], r["weights"]) for r in rank if r["event"] == "val"] for rank in ranks]
    assert vals[0] == vals[1], f"the ranks trained different weights: {vals}"
    assert [step for step, _ in vals[0]] == [VAL_EVERY, 2 * VAL_EVERY, 2 * VAL_EVERY], vals[0]  # + the epoch's end
    assert vals[0][0][1] != vals[0][1][1], "no training between the validations"
    ends = [[r["step"] for r in rank if r["event"] == "epoch_end"] for rank in ranks]
    assert ends == [[2 * VAL_EVERY], [2 * VAL_EVERY]], f"the ranks stopped apart: {ends}"

    resumed = tmp_path / "one"
    monkeypatch.setenv("PORT_OUT", str(resumed))
    launch([their_loop(tree, vocab_ds8, sample, resumed, 1, resume=out / "ckpt" / "last.ckpt", val_every=0.5)],
           tmp_path / "one-logs", RUN_S)
    epoch_ends = [r["step"] for r in reports(resumed, 1)[0] if r["event"] == "epoch_end"]
    assert len(epoch_ends) == 2, epoch_ends  # the rest of epoch 0, then epoch 1
