"""Embedding everyone: every person exactly once, one Parquet file per input shard, resumable after SIGKILL with
another number of ranks, checked by ``shardify embeddings verify`` and merged in person-id order."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset
import pyarrow.parquet as pq
import pytest
import torch
from embed_helpers import broken_copy, embed_in_process, model_for, verify
from helpers import repo_first, scaled, shard_ids, shardify, split_ids, wait_for

from lifeseq_shards import EmbeddingWriter, ShardedDataset, ShardedLoader
from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.embed.store import EmbeddingsError, read_spec, write_shard
from lifeseq_shards.reader import World
from lifeseq_shards.store.remote import read_manifest

SCRIPTS = Path(__file__).resolve().parents[1] / "ddp_scripts"
JOB_S = 240  # one predict job of the tests below, at most (a hang fails)


def every_person(root: Path) -> np.ndarray:
    ids = []
    for split in ("train", "val"):
        shards, rem = split_ids(root, split)
        ids += [*shards, rem]
    return np.sort(np.concatenate(ids))


def merged(out: Path) -> pa.Table:
    target = out.parent / f"{out.name}-merged.parquet"
    code, text = shardify("embeddings", "merge", out, target)
    assert code == 0, text
    return pq.read_table(target)


def script(*args: object) -> list[str]:
    return [sys.executable, str(SCRIPTS / "embed_predict.py"), *map(str, args)]


def run(cmd: list[str], logs: Path) -> None:
    with open(logs, "w") as fh:
        r = subprocess.run(cmd, cwd=SCRIPTS, env=repo_first(dict(os.environ)), stdout=fh, stderr=subprocess.STDOUT,
                           timeout=scaled(JOB_S), start_new_session=True)
    assert r.returncode == 0, logs.read_text()[-3000:]


def finished(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet"))


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_S)
def test_a_job_killed_on_two_ranks_resumes_on_one_and_matches_one_uninterrupted_process(ds: Path,
                                                                                        tmp_path: Path) -> None:
    """lightning ddp on 2 ranks (gloo), SIGKILLed once it has written some shards; started again with 1 rank under
    pytorch_lightning: the output verifies, and every embedding equals a single process's (fp32 tolerance)."""
    assert len(list(read_manifest(ds).entries())) % 2 == 1
    out = tmp_path / "emb"
    with open(tmp_path / "killed.log", "w") as fh:
        job = subprocess.Popen(script(ds, out, "--devices", 2, "--delay", 0.4, "--batch-size", 16), cwd=SCRIPTS,
                               env=repo_first(dict(os.environ)), stdout=fh, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            assert wait_for(lambda: len(finished(out)) >= 2 or job.poll() is not None, JOB_S)
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    before = finished(out)
    assert 2 <= len(before) < 11, before  # killed mid-way
    code, text = shardify("embeddings", "verify", out, "--data", ds)
    assert code == 1 and "missing" in text
    times = {name: (out / name).stat().st_mtime_ns for name in before}

    run(script(ds, out, "--flavour", "pytorch_lightning", "--workers", 2), tmp_path / "resumed.log")
    assert {name: (out / name).stat().st_mtime_ns for name in before} == times  # skipped, not written again
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    code, text = shardify("embeddings", "verify", out, "--data", ds)
    assert code == 0, text

    reference = tmp_path / "reference"
    embed_in_process(ds, reference)
    got, want = merged(out), merged(reference)
    assert got.column("person_id").to_numpy().tolist() == every_person(ds).tolist()
    assert got.column("person_id").equals(want.column("person_id"))
    for name in ("cls", "mean"):
        a, b = (np.stack(t.column(name).to_numpy(zero_copy_only=False)) for t in (got, want))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_plain_loop_writes_each_shard_sorted_and_a_second_run_skips_them(ds: Path, tmp_path: Path) -> None:
    writer = embed_in_process(ds, tmp_path / "emb", dtype="float16")
    assert len(writer.written) == 11
    code, text = shardify("embeddings", "verify", tmp_path / "emb", "--data", ds)
    assert code == 0, text
    table = pq.read_table(tmp_path / "emb" / "train" / "remainder.parquet")
    ids = table.column("person_id").to_numpy()
    assert (np.diff(ids) > 0).all()
    assert table.schema.field("cls").type == pa.list_(pa.float16(), 16)
    all_ids = merged(tmp_path / "emb").column("person_id").to_numpy()
    assert all_ids.tolist() == every_person(ds).tolist()
    as_one = pyarrow.dataset.dataset(tmp_path / "emb").to_table()  # as docs/reference/ddp.md says: no merge needed
    assert sorted(as_one.column("person_id").to_pylist()) == all_ids.tolist()
    assert embed_in_process(ds, tmp_path / "emb", dtype="float16").written == []


def test_lifeseq_data_predicts_for_a_writer_the_shards_left(ds: Path, done: Path, tmp_path: Path) -> None:
    """A plain loop on LifeSeqData (docs/guides/embed.md): predict(writer, model) gives the model's batches of the
    shards the writer has not written, each with its shard; the files are those of the loop on the host batches
    (``done``), and a job started again after losing one file reads only that shard."""
    from lifeseq_shards import LifeSeqData

    def run() -> EmbeddingWriter:
        model, writer = model_for(ds), EmbeddingWriter(tmp_path / "emb")
        data = LifeSeqData(ds, 64, num_workers=0, device="cpu", world=World(0, 1))
        with torch.no_grad():
            for i, batch in enumerate(data.predict(writer, model)):
                writer.write(model.predict_step(batch, i), batch)
        writer.finish()
        return writer

    written = run().written
    assert len(written) == 11
    assert merged(tmp_path / "emb").equals(merged(done))
    written[-1].unlink()
    assert run().written == [written[-1]]
    code, text = shardify("embeddings", "verify", tmp_path / "emb", "--data", ds)
    assert code == 0, text


def test_verify_names_a_damaged_shard(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    path = out / "train" / "shard-000003.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, text = verify(out, ds)
    assert code == 1 and "train/shard-000003.parquet: unreadable" in text, text


def test_verify_names_a_duplicated_shard(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    shutil.copy(out / "val" / "shard-000001.parquet", out / "val" / "shard-000001 (1).parquet")
    code, text = verify(out, ds)
    assert code == 1 and "val/shard-000001 (1).parquet: not the output of any input shard" in text, text


def test_verify_names_a_missing_shard_and_persons_repeated_lost_or_not_finite(ds: Path, done: Path,
                                                                              tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    (out / "train" / "shard-000001.parquet").unlink()
    manifest = read_manifest(ds)
    entries = {e.file: e for _, e in manifest.entries()}
    table = pq.read_table(out / "train" / "shard-000002.parquet")
    ids = table.column("person_id").to_numpy().copy()
    cls = np.stack(table.column("cls").to_numpy(zero_copy_only=False))
    mean = np.stack(table.column("mean").to_numpy(zero_copy_only=False))
    ids[1] = ids[0]  # person ids[1] lost, ids[0] twice
    cls[5, 3] = np.nan
    write_shard(out, entries["train/shard-000002.tar"], read_spec(out), ids, {"cls": cls, "mean": mean})
    code, text = verify(out, ds)
    assert code == 1, text
    assert "train/shard-000001.parquet: missing" in text
    assert f"train/shard-000002.parquet: person {ids[0]} appears more than once" in text
    assert "train/shard-000002.parquet: 1 persons of its input shard missing" in text
    assert "train/shard-000002.parquet: 1 NaN/inf values in cls" in text


def test_an_output_of_another_model_or_dataset_is_refused_by_name(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    other = model_for(ds)
    with torch.no_grad():
        other.encoder.norm.weight.add_(1.0)
    with pytest.raises(EmbeddingsError, match=r"holds other embeddings \(model '[0-9a-f]{32}', not '[0-9a-f]{32}'\)"):
        EmbeddingWriter(out).open(ds, model=other, world=World(0, 1))
    with pytest.raises(EmbeddingsError, match=r"holds other embeddings \(dtype 'float32', not 'float16'\)"):
        EmbeddingWriter(out, dtype="float16").open(ds, model=model_for(ds), world=World(0, 1))
    second = tmp_path / "ds2"
    shutil.copytree(ds, second)
    manifest = second / "manifest.json"
    manifest.write_text(manifest.read_text().replace(read_manifest(ds).fingerprint, "0" * 32))
    code, text = verify(out, second)
    assert code == 1 and f"embeddings of dataset {read_manifest(ds).fingerprint}" in text


def test_verify_and_merge_refuse_bad_usage(ds: Path, tmp_path: Path) -> None:
    assert verify(tmp_path, ds)[0] == 2  # no _embeddings.json
    assert shardify("embeddings", "verify", tmp_path)[0] == 2  # no --data
    assert shardify("embeddings", "merge", tmp_path, tmp_path / "x.parquet")[0] == 2


def test_a_leftover_temporary_file_never_counts_and_is_cleared(ds: Path, done: Path, tmp_path: Path) -> None:
    out = broken_copy(done, tmp_path)
    final = out / "train" / "remainder.parquet"
    final.rename(out / "train" / "remainder.parquet.tmp-0123")  # a write killed before its rename
    code, text = verify(out, ds)
    assert code == 1 and "train/remainder.parquet: missing" in text
    done_files = EmbeddingWriter(out).open(ds, model=model_for(ds), world=World(0, 1))
    assert "train/remainder.tar" not in done_files and len(done_files) == 10
    assert not list(out.rglob("*.tmp-*"))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_each_person_carries_its_shard_and_skipped_shards_are_not_read(ds: Path, packed: bool) -> None:
    manifest = read_manifest(ds)
    files = [e.file for _, e in manifest.entries()]
    skip = {"train/shard-000001.tar", "val/shard-000002.tar"} & set(files)
    assert len(skip) == 2
    seen = []
    for rank in range(2):
        dataset = ShardedDataset(ds, split=("train", "val"), batch_size=40, world=World(rank, 2), num_workers=1,
                                 mode="complete", packed=packed, pad_to=None if packed else 64, skip_files=skip,
                                 shard_field=True)
        for batch in ShardedLoader(dataset):
            model_batch = BatchBuilder()(batch, "cpu", 0)
            seen += zip(model_batch["person_id"].tolist(), model_batch["shard"].tolist(), strict=True)
    owner = {int(p): i for i, f in enumerate(files) for p in shard_ids(ds / f)}
    assert sorted(p for p, _ in seen) == sorted(p for p, i in owner.items() if files[i] not in skip)
    assert all(owner[p] == shard for p, shard in seen)
    with pytest.raises(ValueError, match="skip_files and shard_field are for mode='complete'"):
        ShardedDataset(ds, split="train", world=World(0, 1), shard_field=True)


def test_a_full_disk_leaves_neither_a_finished_nor_a_temporary_file(ds: Path, done: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = broken_copy(done, tmp_path)
    entry = next(e for _, e in read_manifest(ds).entries() if e.file == "val/shard-000000.tar")
    table = pq.read_table(out / "val" / "shard-000000.parquet")
    (out / "val" / "shard-000000.parquet").unlink()

    def disk_full(_table: pa.Table, fh: object) -> None:
        fh.write(b"PAR1 half a file")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    arrays = {n: np.stack(table.column(n).to_numpy(zero_copy_only=False)) for n in ("cls", "mean")}
    with pytest.raises(OSError, match="No space left"):
        write_shard(out, entry, read_spec(out), table.column("person_id").to_numpy(), arrays)
    assert sorted(p.name for p in (out / "val").iterdir() if "shard-000000" in p.name) == []
    code, text = verify(out, ds)
    assert code == 1 and "val/shard-000000.parquet: missing" in text


def test_verify_and_merge_load_no_torch() -> None:
    """`shardify embeddings` runs where the data is, without the training stack."""
    code = "import sys, lifeseq_shards.cli, lifeseq_shards.embed.check; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                       env=repo_first(dict(os.environ)))
    assert r.stdout.strip() == "False", r.stderr


def test_lightning_predict_refuses_to_keep_every_embedding_in_memory(ds: Path, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lifeseq_shards import LifeSeqDataModule

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[EmbeddingWriter(tmp_path / "emb")])
    with pytest.raises(EmbeddingsError, match="pass return_predictions=False"):
        trainer.predict(model_for(ds), datamodule=LifeSeqDataModule(ds, batch_size=64, num_workers=0))
    assert not list((tmp_path / "emb").rglob("*.parquet"))


def test_a_resumed_lightning_predict_says_once_what_is_left_and_nothing_alarming(ds: Path, done: Path, tmp_path: Path,
                                                                                 capfd: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    """Resumed, predict said "Total length of `ShardedLoader` across ranks is zero" (a rank, or the whole job, with
    nothing left) and "Couldn't infer the batch indices" though it wrote what was missing; now rank 0 says "8 of 11
    shards done, reading 3" and Lightning's two warnings about this loader are filtered."""
    import warnings

    import lightning.pytorch as pl

    from lifeseq_shards import LifeSeqDataModule

    out = broken_copy(done, tmp_path)
    for lost in sorted(out.rglob("*.parquet"))[:3]:
        lost.unlink()

    def predict() -> list[str]:
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[EmbeddingWriter(out)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.predict(model_for(ds), datamodule=LifeSeqDataModule(ds, batch_size=64, num_workers=0),
                            return_predictions=False)
        return [str(w.message) for w in seen if "ShardedLoader" in str(w.message)]

    assert predict() == []
    err = capfd.readouterr().err
    assert err.count("shards done") == 1 and f"EmbeddingWriter {out}: 8 of 11 shards done, reading 3\n" in err, err
    assert predict() == []  # nothing left: a pass of no batches
    assert f"EmbeddingWriter {out}: 11 of 11 shards done, reading 0\n" in capfd.readouterr().err
    assert shardify("embeddings", "verify", out, "--data", ds)[0] == 0
