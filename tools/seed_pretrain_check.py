"""The researchers' own ``pretrain.py``, patched by docs/seed-pretrain.diff, on one Python stack: it fits on 2 ranks
(gloo, torchrun), is SIGKILLed mid-epoch, resumes from a checkpoint and predicts; one verdict line per step, exit 0
when every step passes (results: docs/results/seed-pretrain.md).

    python -m tools.seed_pretrain_check REPO --python PY --deps DIR --work DIR

REPO is their git repository (a clone or a bare mirror; ``--commit``, default 884ef02): a copy of that commit goes into
WORK and the diff is applied there. PY is the Python whose torch / Lightning are checked (this checkout's
lifeseq_shards is put first on its path); DIR holds what their code imports that PY lacks (performer-pytorch 1.1.4,
pandas, polars...: ``pip install --no-deps --target DIR``). The data are the first ``--persons`` persons of their
sample's encoded_mlm.h5 (and the same persons of encoded_nomlm.h5 for predict), converted by this project: by
default the copy tests/data/lifeseq-sample carries, another with ``--sample``.

Steps: ``apply`` (git apply), ``data`` (convert), ``fit`` (uninterrupted; every train person once per epoch, ranks in
step), ``kill`` (the same run, SIGKILLed after a checkpoint in the last epoch), ``resume`` twice (from the newest
``every_n_train_steps`` checkpoint, saved at a batch's end, and from the newest of their own ``ModelCheckpoint``'s,
saved after a mid-epoch validation: the steps after it read the same persons, with the same losses, learning rates
and final weights, as the uninterrupted run's), ``predict`` (docs/reference/ddp.md's lines: everyone embedded once,
``shardify embeddings verify`` clean); with ``--against`` another stack's WORK, ``against`` (the uninterrupted runs
read the same persons with the same learning rates at every step). What the run adds to theirs, and why:
tools/seed_pretrain_rank.py. ``--packed 512`` (or ``unpadded``) runs it all on packed, token-balanced batches (the
diff's hparams ``packed`` and ``tokens_per_batch``: ``--tokens-per-batch``); predict then checks that the embeddings
record that mode.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DIFF = REPO_ROOT / "docs" / "seed-pretrain.diff"
RANK = Path(__file__).with_name("seed_pretrain_rank.py")
SAMPLE = REPO_ROOT / "tests" / "data" / "lifeseq-sample"  # the sample carried in this repository
RANKS = 2
THEIR_ARGS = ["--accelerator", "cpu", "--ddpstrategy", "gloo", "--devices", str(RANKS)]

# their regular_hparams_small.txt, made tiny for 2 CPU cores, with every dropout 0 (a dropout mask comes from the
# global RNG, which no checkpoint holds, so a resumed run could not match the uninterrupted one bit for bit)
HPARAMS = """\
vocab_size: {vocab_size}
epochs: {epochs}
batch_size: {batch_size}
max_length: 512
hidden_size: 32
hidden_ff: 64
hidden_act: "swish"
n_encoders: 1
n_heads: 4
n_local: 2
local_window_size: 16
norm_type: "rezero"
att_dropout: 0.0
fw_dropout: 0.0
dc_dropout: 0.0
emb_dropout: 0.0
parametrize_emb: True
norm_input_emb: False
norm_output_emb: True
weight_tying: "wt"
training_task: mlm
experiment_name: seed_pretrain_check
experiment_version: 1
attention_type: "performer"
multihead_dc: False
num_random_features: 16
learning_rate: 2.e-3
weight_decay: 0.01
beta1: 0.9
beta2: 0.999
cls_num_targs: 3
epsilon: 1.e-6
stage: "pre_training"
implementation: "v1"
version: 1.0
"""


def packed_hparams(args: argparse.Namespace) -> str:
    """The diff's hparams for packed, token-balanced batches (``--packed``: 512 or unpadded); none without."""
    if args.packed is None:
        return ""
    return f'packed: "{args.packed}"\ntokens_per_batch: {args.tokens_per_batch}\n'


def expected_padding(packed: str | None) -> str:
    """What the embeddings of a run with ``--packed`` must record (lifeseq_shards.embed.spec.Padding)."""
    if packed is None:
        return "padded pad_to=512"  # their max_length, the predict data padded to it
    return "packed unpadded" if packed == "unpadded" else f"packed pad_to={packed}"


class CheckFailed(Exception):
    """A step's verdict: what differs."""


@dataclass
class Check:
    args: argparse.Namespace
    work: Path
    env: dict[str, str] = field(default_factory=dict)
    failed: bool = False

    def step(self, name: str, fn: Any, *a: Any) -> Any:
        """Run one step; print its verdict line. A failed step fails the check; the steps after it that need its
        result are skipped."""
        t = time.monotonic()
        try:
            detail, result = fn(*a)
        except CheckFailed as e:
            print(f"FAIL {name}: {e}", flush=True)
            self.failed = True
            return None
        print(f"PASS {name}: {detail} ({time.monotonic() - t:.0f} s)", flush=True)
        return result

    # -- apply ------------------------------------------------------------------------------------------------
    def apply(self) -> tuple[str, Path]:
        theirs = self.work / "their-repo"
        files = their_copy(Path(self.args.repo), self.args.commit, theirs, patch=True)
        return f"{DIFF.name} applies to {self.args.commit} ({', '.join(files)})", theirs

    # -- data -------------------------------------------------------------------------------------------------
    def data(self) -> tuple[str, dict[str, Any]]:
        import h5py
        import numpy as np

        sample, n = Path(self.args.sample), self.args.persons
        out = self.work / "data"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with h5py.File(sample / "encoded_mlm.h5") as f:
            ids = f["sequence_id"][:n]
        for name in ("encoded_mlm.h5", "encoded_nomlm.h5"):  # the same persons in both (their row orders differ)
            with h5py.File(sample / name) as f, h5py.File(out / name, "w") as g:
                rows = np.flatnonzero(np.isin(f["sequence_id"][:], ids))
                g.attrs.update(f.attrs)
                for key, ds in f.items():
                    g.create_dataset(key, data=ds[rows], compression="gzip", chunks=True).attrs.update(ds.attrs)
        shards = {}
        for name, split in (("encoded_mlm.h5", "mlm"), ("encoded_nomlm.h5", "nomlm")):
            self.run([self.args.python, "-m", "lifeseq_shards.cli", "convert", str(out / name), "--vocab",
                      str(sample / "vocab.csv"), "-o", str(out / split), "--nodes", "1", "--gpus", str(RANKS),
                      "--workers", "2", "--min-shard-persons", "50",
                      # one val batch a rank: a val split the ranks cannot read in equal batches is refused
                      "--num-val", str(RANKS * self.args.batch_size)], out / f"convert-{split}.log")
            shards[split] = json.loads((out / split / "manifest.json").read_text())
        train, val = (shards["mlm"]["splits"][s]["persons"] for s in ("train", "val"))
        vocab = sum(1 for _ in open(sample / "vocab.csv")) - 1
        return (f"{len(ids)} persons of {sample.name} -> mlm/ (train {train}, val {val}) and nomlm/",
                {"dir": out, "ids": {int(i) for i in ids}, "train": train, "vocab": vocab})

    # -- fit / kill / resume ------------------------------------------------------------------------------------
    def config(self, name: str, data: dict[str, Any], resume: Path | None = None) -> Path:
        run = self.work / name
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        hparams = run / "hparams.txt"
        hparams.write_text(HPARAMS.format(vocab_size=data["vocab"], epochs=self.args.epochs,
                                          batch_size=self.args.batch_size) + packed_hparams(self.args))
        cfg = {"CHECKPOINT_DIR": str(run / "ckpt"), "SHARDS_PATH": str(data["dir"] / "mlm"),
               "HPARAMS_PATH": str(hparams), "VOCAB_PATH": str(Path(self.args.sample) / "vocab.csv")}
        if resume is not None:
            cfg["RESUME_FROM_CHECKPOINT"] = str(resume)
        (run / "config.json").write_text(json.dumps(cfg, indent=1))
        return run

    def fit(self, run: Path, kill_at: int | None = None) -> int:
        """Their pretrain.py under torchrun; with ``kill_at``, SIGKILLed once both ranks have passed that step."""
        cmd = [self.args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(RANK), "fit", str(run / "config.json"), str(run / "records"), str(self.args.every), "--",
               *THEIR_ARGS]
        watch = None if kill_at is None else lambda: min(last_steps(run / "records")) >= kill_at
        return self.run(cmd, run / "fit.log", kill_when=watch, check=kill_at is None)

    def full(self, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        run = self.config("full", data)
        self.fit(run)
        records = read_records(run / "records")
        lengths = {len(r) for r in records.values()}
        if len(lengths) != 1:
            raise CheckFailed(f"the ranks took different numbers of steps: {sorted(lengths)}")
        steps = lengths.pop()
        per_epoch = steps // self.args.epochs
        for epoch in range(self.args.epochs):
            ids = [i for r in records.values() for line in r.values() if line["epoch"] == epoch for i in line["ids"]]
            if len(ids) != data["train"] or len(set(ids)) != len(ids) or not set(ids) <= data["ids"]:
                raise CheckFailed(f"epoch {epoch} read {len(ids)} ids, {len(set(ids))} distinct, of "
                                  f"{data['train']} train persons")
        return (f"{RANKS} ranks x {self.args.epochs} epochs x {per_epoch} steps, every one of the {data['train']} "
                f"train persons once per epoch", {"run": run, "records": records, "per_epoch": per_epoch})

    def kill(self, data: dict[str, Any], full: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        per_epoch = full["per_epoch"]
        kill_at = (self.args.epochs - 1) * per_epoch + per_epoch // 2 + 3  # after their mid-epoch validation
        run = self.config("killed", data)
        rc = self.fit(run, kill_at=kill_at)
        if rc != -signal.SIGKILL:
            raise CheckFailed(f"the run ended by itself (exit {rc}) before step {kill_at}")
        last = last_steps(run / "records")[0]  # rank 0's: it saves, after recording the step
        steps = {int(p.stem.split("=")[-1]): p for p in (run / "ckpt" / "steps").glob("step-step=*.ckpt")}
        theirs = {int(p.stem.split("step=")[1].split("-")[0]): p for p in (run / "ckpt").glob("model-*.ckpt")}
        pick = {"steps": max((s for s in steps if s < last), default=None),
                "theirs": max((s for s in theirs if s < last), default=None)}
        if None in pick.values():
            raise CheckFailed(f"killed after step {last} with checkpoints at steps {sorted(steps)} (every_n_train_"
                              f"steps) and {sorted(theirs)} (theirs): none of each kind before the kill")
        epoch, batch = divmod(last, per_epoch)
        return (f"SIGKILL after step {last} ({batch} of epoch {epoch}'s {per_epoch} batches); resuming from "
                f"{steps[pick['steps']].name} and {theirs[pick['theirs']].name}",
                {"run": run, "ckpt": {"steps": steps[pick["steps"]], "theirs": theirs[pick["theirs"]]},
                 "saved": pick})

    def resume(self, data: dict[str, Any], full: dict[str, Any], killed: dict[str, Any],
               which: str) -> tuple[str, Path]:
        ckpt, saved = killed["ckpt"][which], killed["saved"][which]
        run = self.config(f"resumed-{which}", data, resume=ckpt)
        self.fit(run)
        after = read_records(run / "records")
        compare_resumed(full["records"], read_records(killed["run"] / "records"), after, saved)
        differ = differing_weights(full["run"] / "records" / "final.pt", run / "records" / "final.pt")
        if differ:
            raise CheckFailed(f"final weights differ from the uninterrupted run's: {differ[:5]}")
        n = len(after[0])
        return (f"{ckpt.name}: steps {saved + 1}-{saved + n} read the same persons with the same losses and learning "
                "rates as the uninterrupted run, on both ranks; final weights equal", run)

    # -- predict ----------------------------------------------------------------------------------------------
    def predict(self, data: dict[str, Any], resumed: Path) -> tuple[str, None]:
        ckpt = max((resumed / "ckpt").glob("model-*.ckpt"), key=lambda p: p.stat().st_mtime)
        emb = self.work / "emb"
        shutil.rmtree(emb, ignore_errors=True)
        nomlm = data["dir"] / "nomlm"
        self.run([self.args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                  str(RANK), "predict", str(resumed / "config.json"), str(ckpt), str(emb), str(nomlm)],
                 self.work / "predict.log")
        verify = self.run([self.args.python, "-m", "lifeseq_shards.cli", "embeddings", "verify", str(emb), "--data",
                           str(nomlm)], self.work / "verify.log", check=False)
        if verify:
            raise CheckFailed(f"shardify embeddings verify exited {verify}: {(self.work / 'verify.log').read_text()}")
        ids = embedded_ids(self.args.python, emb, self.env)
        if len(ids) != len(set(ids)) or set(ids) != data["ids"]:
            raise CheckFailed(f"{len(ids)} rows, {len(set(ids))} persons, of {len(data['ids'])}")
        padding = json.loads((emb / "_embeddings.json").read_text()).get("padding")
        if padding != expected_padding(self.args.packed):
            raise CheckFailed(f"the embeddings record padding {padding!r}, not {expected_padding(self.args.packed)!r}")
        return (f"{ckpt.name}: all {len(ids)} persons embedded once each, padding {padding!r}; shardify embeddings "
                "verify clean", None)

    # -- against another stack ------------------------------------------------------------------------------------
    def against(self, full: dict[str, Any], other: Path) -> tuple[str, None]:
        """The uninterrupted run's batches and learning rates are the other stack's, step for step (losses differ
        in their last bits between torch versions: reported, not compared)."""
        theirs = read_records(other / "full" / "records")
        worst = 0.0
        for rank, mine in full["records"].items():
            if sorted(mine) != sorted(theirs[rank]):
                raise CheckFailed(f"rank {rank}: {len(mine)} steps here, {len(theirs[rank])} in {other}")
            for s, line in mine.items():
                for key in ("epoch", "batch", "ids", "lr"):
                    if line[key] != theirs[rank][s][key]:
                        raise CheckFailed(f"rank {rank} step {s}: {key} differs from {other}'s")
                worst = max(worst, abs(float.fromhex(line["loss"]) - float.fromhex(theirs[rank][s]["loss"])))
        return (f"the same persons and learning rates at every step as {other}'s uninterrupted run; losses within "
                f"{worst:.1e}", None)

    # -- processes --------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], log: Path, kill_when: Any = None, check: bool = True) -> int:
        """``cmd`` with its output in ``log``; refused (CheckFailed) past --timeout or, with ``check``, on a
        non-zero exit. ``kill_when``: a test polled every second; once true, every process of the run is
        SIGKILLed (the ranks first: torchrun starts each in a session of its own)."""
        with open(log, "w") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            deadline = time.monotonic() + self.args.timeout
            while p.poll() is None:
                if time.monotonic() > deadline or (kill_when is not None and kill_when()):
                    for pid in [*descendants(p.pid), p.pid]:
                        with _gone():
                            os.kill(pid, signal.SIGKILL)
                    p.wait()
                    if time.monotonic() > deadline:
                        raise CheckFailed(f"{' '.join(cmd[:6])}... ran past {self.args.timeout} s (log: {log})")
                    break
                time.sleep(1)
        for pid in descendants(p.pid):  # nothing of a run outlives it
            with _gone():
                os.kill(pid, signal.SIGKILL)
        if check and p.returncode:
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            raise CheckFailed(f"{' '.join(cmd[:6])}... exited {p.returncode} (log: {log}):\n{tail}")
        return p.returncode


def their_copy(repo: Path, commit: str, dest: Path, patch: bool, paths: tuple[str, ...] = ()) -> list[str]:
    """``git archive`` of their ``commit`` (only ``paths``, if given) into ``dest`` (emptied first); with ``patch``,
    docs/seed-pretrain.diff applied there. Returns the files the diff changed (CheckFailed when the commit or the
    diff does not apply)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", commit, *paths], capture_output=True, check=False)
    if archive.returncode:
        raise CheckFailed(f"git archive {commit} in {repo}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    if not patch:
        return []
    applied = subprocess.run(["git", "apply", "-v", str(DIFF)], cwd=dest, capture_output=True, text=True,
                             check=False)
    if applied.returncode:
        raise CheckFailed(f"{DIFF.name} does not apply to {commit}: {applied.stderr.strip()}")
    return [ln.split()[2] for ln in applied.stderr.splitlines() if ln.startswith("Applied patch")]


class _gone:
    """Ignore a process that has ended already."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *_: object) -> bool:
        return kind is ProcessLookupError


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first listed before theirs), from /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


Records = dict[int, dict[int, dict[str, Any]]]  # rank -> optimizer step -> what the recorder wrote for it


def read_records(records: Path) -> Records:
    """rank -> optimizer step -> what the recorder wrote for it (a step recorded twice is refused)."""
    out: Records = {}
    for rank in range(RANKS):
        steps: dict[int, dict[str, Any]] = {}
        for line in _lines(records / f"rank{rank}.jsonl"):
            if line["step"] in steps:
                raise CheckFailed(f"{records}: rank {rank} recorded step {line['step']} twice")
            steps[line["step"]] = line
        out[rank] = steps
    return out


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        for text in path.read_text().splitlines():
            if text.endswith("}"):  # a line cut by the SIGKILL is not a step
                yield json.loads(text)


def last_steps(records: Path) -> list[int]:
    """Each rank's last recorded step (0 before its first)."""
    return [max((line["step"] for line in _lines(records / f"rank{r}.jsonl")), default=0) for r in range(RANKS)]


def compare_resumed(uninterrupted: Records, killed: Records, resumed: Records, saved: int) -> None:
    """The killed run's steps up to the checkpoint's (``saved``), then the resumed run's, must be the uninterrupted
    run's steps, each with the same epoch, batch index, person ids, loss and learning rate (CheckFailed else)."""
    for rank, expected in uninterrupted.items():
        got = {s: line for s, line in killed[rank].items() if s <= saved} | resumed[rank]
        if sorted(got) != sorted(expected):
            missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
            raise CheckFailed(f"rank {rank}: steps {missing[:5]} missing, {extra[:5]} extra")
        for s in sorted(got):
            for key in ("epoch", "batch", "ids", "loss", "lr"):
                if got[s][key] != expected[s][key]:
                    raise CheckFailed(f"rank {rank} step {s}: {key} differs from the uninterrupted run's "
                                      f"(resumed {got[s][key]!r:.80}, uninterrupted {expected[s][key]!r:.80})")


def differing_weights(a: Path, b: Path) -> list[str]:
    import torch

    x, y = torch.load(a), torch.load(b)
    return sorted(set(x) ^ set(y)) + [k for k in sorted(set(x) & set(y)) if not torch.equal(x[k], y[k])]


STACK = ("torch", "lightning", "pytorch_lightning", "numpy", "torchmetrics", "webdataset", "pyarrow", "h5py",
         "performer_pytorch", "local_attention", "einops", "pandas", "polars")


def stack(python: str, env: dict[str, str]) -> str:
    """Python's and the versions of what the run imports, as ``python`` with ``env`` sees them."""
    code = ("import importlib.metadata as m, sys; print('Python', sys.version.split()[0], *(f'{d} ' + m.version(d) "
            "for d in sys.argv[1:]))")
    names = [n.replace("_", "-") for n in STACK]
    out = subprocess.run([python, "-c", code, *names], env=env, capture_output=True, text=True, check=False)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


def embedded_ids(python: str, emb: Path, env: dict[str, str]) -> list[int]:
    """The person ids in the embedding files, read with ``python``'s pyarrow (the directory reads as one table)."""
    code = ("import pyarrow.dataset as ds, sys, json; "
            "print(json.dumps(ds.dataset(sys.argv[1]).to_table(columns=['person_id']).column(0).to_pylist()))")
    out = subprocess.run([python, "-c", code, str(emb)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", help="their repository: a clone or a bare mirror")
    p.add_argument("--commit", default="884ef02")
    p.add_argument("--python", default=sys.executable, help="the stack to check (default: this Python)")
    p.add_argument("--deps", required=True, help="a directory with what their code imports that PY lacks")
    p.add_argument("--work", required=True, help="a scratch directory (emptied step by step)")
    p.add_argument("--sample", default=str(SAMPLE),
                   help="their sample: encoded_mlm.h5, encoded_nomlm.h5, vocab.csv (default: the carried copy)")
    p.add_argument("--persons", type=int, default=600)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--every", type=int, default=4, help="ModelCheckpoint(every_n_train_steps=...)")
    p.add_argument("--against", help="another stack's --work, whose uninterrupted run this one's must match")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for one run")
    p.add_argument("--packed", help="train on packed batches (the diff's hparams `packed`): 512 (their model padded "
                                    "to 512) or unpadded")
    p.add_argument("--tokens-per-batch", type=int, default=2048, help="with --packed: each rank's token budget")
    p.add_argument("--resume", choices=("both", "steps"), default="both",
                   help="resume from both kinds of checkpoint, or from the every_n_train_steps one only")
    args = p.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    check = Check(args, work)
    theirs = check.step("apply", check.apply)
    if theirs is None:
        sys.exit(1)
    path = [str(REPO_ROOT), str(theirs), str(Path(args.deps).resolve())]
    check.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
    print(f"stack: {stack(args.python, check.env)}", flush=True)
    data = check.step("data", check.data)
    full = data and check.step("fit", check.full, data)
    killed = full and check.step("kill", check.kill, data, full)
    resumed = None
    if killed:
        resumed = check.step("resume (every_n_train_steps checkpoint)", check.resume, data, full, killed, "steps")
        if args.resume == "both":
            check.step("resume (their ModelCheckpoint)", check.resume, data, full, killed, "theirs")
    if resumed:
        check.step("predict", check.predict, data, resumed)
    if full and args.against:
        check.step("against", check.against, full, Path(args.against).resolve())
    print(("FAIL" if check.failed else "PASS") + f": {args.python} (work: {work})")
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
