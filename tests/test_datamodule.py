"""LifeSeqDataModule in one process: both Lightning packages, the vocabulary from the manifest, the README example,
the resume position handed over whenever the loader is built, and the check that refuses a loader out of step.
The multi-process runs (DDP, ddp_spawn, resume under Lightning, predict) are in tests/reader/test_ddp.py."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import shardify, split_ids

from lifeseq_shards.datamodule import LifeSeqDataModule
from lifeseq_shards.device.build import padded_fields
from lifeseq_shards.masking import GRAPHED, OFFLINE, DynamicMasker, MaskingConfig
from lifeseq_shards.model import EncoderConfig
from lifeseq_shards.store.remote import read_manifest

README = Path(__file__).resolve().parents[1] / "README.md"
SAMPLE_IDS = 2970  # vocab.csv of the sample: ids 0..2969
LEN_WARNING = "Your `IterableDataset` has `__len__` defined"


def fake_trainer(ready: int = 0, epoch: int = 0, batches: float = float("inf")) -> Any:
    """What the DataModule reads of a Trainer, for tests that drive its hooks by hand."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=ready))
    return SimpleNamespace(global_rank=0, world_size=1, training=True, predicting=False, current_epoch=epoch,
                           num_training_batches=batches, strategy=SimpleNamespace(root_device=torch.device("cpu")),
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def fitting_trainer(ready: int, started: int, processed: int, completed: int) -> Any:
    """A Trainer inside trainer.fit with Lightning's batch progress of the current epoch."""
    trainer = fake_trainer(ready)
    trainer.state = SimpleNamespace(fn="fit")
    trainer.fit_loop.epoch_loop.batch_progress.current = SimpleNamespace(ready=ready, started=started,
                                                                         processed=processed, completed=completed)
    return trainer


def full_unpickling(trainer_class: type) -> dict[str, bool]:
    """``weights_only=False`` for Trainer.validate / fit / predict where they take it (Lightning >= 2.4 does; 2.2
    always unpickles fully)."""
    return {"weights_only": False} if "weights_only" in inspect.signature(trainer_class.validate).parameters else {}


def module(root: Path, trainer: Any = None, **kw: Any) -> LifeSeqDataModule:
    dm = LifeSeqDataModule(root, batch_size=64, num_workers=0, **kw)
    dm.trainer = trainer
    return dm


# -- the vocabulary -----------------------------------------------------------------------------------------------
def test_vocab_size_comes_from_the_manifest(vocab_dataset: Path, nomlm_dataset: Path) -> None:
    dm = module(vocab_dataset, masking=MaskingConfig())
    assert dm.masking.vocab_size == dm.vocab_size == SAMPLE_IDS  # type: ignore[union-attr]
    assert module(vocab_dataset, masking=MaskingConfig(vocab_size=SAMPLE_IDS)).masking == dm.masking
    with pytest.raises(ValueError, match=f"vocab_size=2971.*has {SAMPLE_IDS} ids"):
        module(vocab_dataset, masking=MaskingConfig(vocab_size=SAMPLE_IDS + 1))
    # an .h5 converted without --vocab: the manifest cannot tell, the configuration must
    with pytest.raises(ValueError, match="no vocab_size.*--vocab"):
        module(nomlm_dataset, masking=MaskingConfig())
    assert module(nomlm_dataset, masking=MaskingConfig(vocab_size=SAMPLE_IDS)).builder.masking is not None


def test_the_manifest_is_read_once(vocab_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DataModule reads the manifest; each loader's dataset takes that one instead of reading it again."""
    from lifeseq_shards.reader import dataset as reader_dataset

    dm = module(vocab_dataset, fake_trainer())

    def again(root: str) -> None:
        raise AssertionError(f"{root}: the manifest was read again")

    monkeypatch.setattr(reader_dataset, "read_manifest", again)
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.predict_dataloader()):
        assert loader.dataset.manifest is dm.manifest


def test_a_dynamic_masker_is_launched_as_given(vocab_dataset: Path) -> None:
    """masking=DynamicMasker(cfg, GRAPHED): the configuration checked against the manifest as any, the masker
    launched as given (a public option, not a swapped builder), the same masks as the eager one."""
    cfg = MaskingConfig(vocab_size=SAMPLE_IDS, seed=2)
    graphed = module(vocab_dataset, masking=DynamicMasker(cfg, GRAPHED))
    assert graphed.masking == cfg
    assert isinstance(graphed.builder.masking, DynamicMasker) and graphed.builder.masking.launch == GRAPHED
    with pytest.raises(ValueError, match=f"vocab_size=2971.*has {SAMPLE_IDS} ids"):
        module(vocab_dataset, masking=DynamicMasker(MaskingConfig(vocab_size=SAMPLE_IDS + 1)))
    eager = module(vocab_dataset, masking=cfg)
    host = next(iter(eager.train_dataloader()))
    got, want = graphed.builder(host, "cpu", 0), eager.builder(host, "cpu", 0)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_readme_example_runs(vocab_dataset: Path) -> None:
    """The README's Python example, on the sample converted with its vocabulary."""
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    namespace: dict[str, Any] = {}
    exec(block.group(1).replace('"ds/"', repr(str(vocab_dataset))), namespace)  # noqa: S102 (our own README)
    assert namespace["dm"].masking.vocab_size == SAMPLE_IDS


# -- both Lightning packages ----------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flavour", ["lightning", "pytorch_lightning"])
def test_trainer_of_either_package_fits_without_the_len_warning(vocab_dataset: Path, flavour: str) -> None:
    """First contact: the user's Trainer, ours from the module of their package; dynamic masking with the
    manifest's vocabulary (the model's embedding takes every drawn id); Lightning's "__len__ could be inaccurate"
    warning not raised for our loaders."""
    if flavour == "pytorch_lightning":
        import pytorch_lightning as pl

        from lifeseq_shards.pl import LifeSeqDataModule as DataModule
        from lifeseq_shards.pl import LifeSeqPretrainModule as Model
    else:
        import lightning.pytorch as pl

        from lifeseq_shards import LifeSeqDataModule as DataModule
        from lifeseq_shards.model import LifeSeqPretrainModule as Model
    dm = DataModule(vocab_dataset, batch_size=32, num_workers=0, masking=MaskingConfig())
    assert isinstance(dm, pl.LightningDataModule) and type(dm).__qualname__ == "LifeSeqDataModule"
    model = Model(EncoderConfig(16, 32, 1, 2), vocab_size=dm.vocab_size)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    assert not [w for w in caught if LEN_WARNING in str(w.message)]


# -- resume -------------------------------------------------------------------------------------------------------
def ids(batch: dict[str, Any]) -> list[int]:
    return padded_fields(batch)["person_id"].tolist()


@pytest.mark.slow
def test_restored_position_reaches_the_loader_whenever_it_is_built(vocab_dataset: Path) -> None:
    """Lightning restores the DataModule's state before the train loader exists (ddp, and the loader that
    estimated_stepping_batches builds), or after (strategies that restore after setup): the same batches follow."""
    first = module(vocab_dataset, fake_trainer())
    it = iter(first.train_dataloader())
    head = [ids(next(it)) for _ in range(3)]
    state = first.state_dict()
    rest = [ids(b) for b in it]
    assert state["train"]["batches"] == 3 and len(rest) > 3

    before = module(vocab_dataset, fake_trainer())
    before.load_state_dict(state)
    after = module(vocab_dataset, fake_trainer())
    loader = after.train_dataloader()
    after.load_state_dict(state)
    for dm in (before, after):
        assert [ids(b) for b in (dm.train_dataloader() if dm is before else loader)] == rest
    assert head + rest == [ids(b) for b in module(vocab_dataset, fake_trainer()).train_dataloader()]


def test_prefetched_batch_is_not_counted_as_trained(vocab_dataset: Path) -> None:
    """prefetch builds batch i+1 while step i runs: the position saved at step i is i, so the resume gives i+1."""
    full = [b["person_id"].tolist() for b in module(vocab_dataset, fake_trainer(), prefetch=True).train_dataloader()]
    dm = module(vocab_dataset, fake_trainer(), prefetch=True)
    it = iter(dm.train_dataloader())
    for i in range(3):
        batch = next(it)
        dm.trainer = fake_trainer(ready=i)
        dm.on_after_batch_transfer(batch, 0)  # the check counts the batch ahead out too
    state = dm.state_dict()
    assert state["train"]["batches"] == 3
    resumed = module(vocab_dataset, fake_trainer(), prefetch=True)
    resumed.load_state_dict(state)
    assert [b["person_id"].tolist() for b in resumed.train_dataloader()] == full[3:]


def test_limited_epoch_checkpoint_resumes_at_the_next_epoch(vocab_dataset: Path) -> None:
    """limit_train_batches=3: after 3 batches the epoch is over, so the state points at the next one."""
    dm = module(vocab_dataset, fake_trainer(batches=3))
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    assert (dm.state_dict()["train"]["epoch"], dm.state_dict()["train"]["batches"]) == (1, 0)


@pytest.mark.slow
def test_checkpoint_inside_a_training_batch_resumes_at_that_batch(vocab_dataset: Path) -> None:
    """Lightning's SLURM requeue handler (SIGUSR1) saves wherever the step stands. Saved inside batch 3's step
    (Lightning's progress: 3 ready and started, 2 processed and completed), the fit resumes by training batch 3
    again, so the data must resume at batch 3 too; saved in on_train_batch_end (3 processed), after it."""
    full = [ids(b) for b in module(vocab_dataset, fake_trainer()).train_dataloader()]
    for processed, resume_at in ((2, 2), (3, 3)):
        dm = module(vocab_dataset, fake_trainer())
        it = iter(dm.train_dataloader())
        for _ in range(3):
            next(it)
        dm.trainer = fitting_trainer(ready=3, started=3, processed=processed, completed=2)
        state = dm.state_dict()
        assert state["train"]["batches"] == resume_at
        resumed = module(vocab_dataset, fake_trainer())
        resumed.load_state_dict(state)
        assert [ids(b) for b in resumed.train_dataloader()] == full[resume_at:]


@pytest.mark.timeout(120)
def test_a_checkpoint_restored_to_validate_does_not_move_a_later_fit(vocab_dataset: Path, tmp_path: Path) -> None:
    """trainer.validate(ckpt_path=...) restores the DataModule's state too; a fit started afterwards without
    ckpt_path starts at epoch 0, batch 0, and must not inherit the validated checkpoint's position."""
    import lightning.pytorch as pl

    from lifeseq_shards.model import LifeSeqPretrainModule

    def trainer() -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0)

    class Validated(LifeSeqPretrainModule):
        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

    dm = LifeSeqDataModule(vocab_dataset, batch_size=32, num_workers=0, masking=MaskingConfig())
    model = Validated(EncoderConfig(16, 32, 1, 2), vocab_size=dm.vocab_size)
    first = trainer()
    first.fit(model, datamodule=dm)
    first.save_checkpoint(tmp_path / "three.ckpt")
    fresh = LifeSeqDataModule(vocab_dataset, batch_size=32, num_workers=0, masking=MaskingConfig())
    trainer().validate(model, datamodule=fresh, ckpt_path=tmp_path / "three.ckpt", **full_unpickling(pl.Trainer))
    again = trainer()
    again.fit(model, datamodule=fresh)  # raised: "the train loader is at batch 4 ... the trainer at batch 1"
    assert again.global_step == 3 and fresh.state_dict()["train"]["batches"] == 3


def test_loader_out_of_step_with_the_trainer_is_refused(vocab_dataset: Path) -> None:
    """The failure this guards against: the loader replays the epoch from batch 0 while the trainer resumes at
    batch 7 (a position restored after the pass began, or never)."""
    dm = module(vocab_dataset, fake_trainer(ready=7))
    batch = next(iter(dm.train_dataloader()))
    with pytest.raises(RuntimeError, match="loader is at batch 1 of epoch 0 but the trainer at batch 8 of epoch 0"):
        dm.on_after_batch_transfer(batch, 0)
    dm.trainer = fake_trainer(ready=0)
    assert dm.on_after_batch_transfer(batch, 0)["input_ids"].dtype == torch.int64


def test_dynamic_cls_task_on_an_offline_mlm_dataset_is_refused(mlm_dataset: Path) -> None:
    """Its stored sequences are the seed's after its CLS task: about 10% already reversed or shuffled, yet a new CLS
    task would label them 0 (original order), or reverse a reversed one back and label it 1. Refused, naming the two
    ways out; dynamic MLM without the CLS task is fine (the seed's own masks are drawn on those sequences too)."""
    from lifeseq_shards.reader import ShardedDataset

    stored_cls = [int(c) for b in ShardedDataset(mlm_dataset, split="train", batch_size=256, pad_to=512)
                  for c in b.tensors["target_cls"]]
    assert sum(c != 0 for c in stored_cls) > 0.05 * len(stored_cls)  # what a new CLS task would mislabel
    for masking in (MaskingConfig(vocab_size=SAMPLE_IDS), MaskingConfig(vocab_size=SAMPLE_IDS, p_reverse=0.0)):
        with pytest.raises(ValueError, match="offline-MLM.*after the seed's CLS task.*encoded_nomlm.h5.*"
                                             "cls_task=False"):
            module(mlm_dataset, masking=masking)
    dm = module(mlm_dataset, masking=MaskingConfig(vocab_size=SAMPLE_IDS, cls_task=False))
    assert isinstance(dm.builder.masking, DynamicMasker) and not dm.builder.masking.cfg.cls_task


def test_offline_masking_is_one_value_said_by_its_word_too(mlm_dataset: Path, nomlm_dataset: Path) -> None:
    """masking=OFFLINE and masking="offline" are the same choice, the stored masks, and a dataset without them
    refuses either; no other word is taken."""
    for masking in (OFFLINE, "offline"):
        dm = module(mlm_dataset, masking=masking)
        assert dm.masking is OFFLINE and dm.builder.masking is OFFLINE
        with pytest.raises(ValueError, match="masking='offline' but the dataset has no offline MLM fields"):
            module(nomlm_dataset, masking=masking)
    with pytest.raises(ValueError, match=r"masking must be None, 'offline' \(OFFLINE\) or a MaskingConfig, not "
                                         "'stored'"):
        module(mlm_dataset, masking="stored")


# -- predict ------------------------------------------------------------------------------------------------------
def test_predict_refuses_an_offline_mlm_dataset(mlm_dataset: Path) -> None:
    """Its stored sequences are the seed's after the CLS task (some reversed or shuffled): not what to embed."""
    with pytest.raises(ValueError, match="offline-MLM.*reversed or shuffled"):
        module(mlm_dataset, masking="offline").predict_dataloader()


def test_predict_batches_are_never_masked(vocab_dataset: Path) -> None:
    dm = module(vocab_dataset, SimpleNamespace(global_rank=0, world_size=1, training=False, predicting=True,
                                               current_epoch=0), masking=MaskingConfig(p_reverse=0.5, p_shuffle=0.5))
    for host in dm.predict_dataloader():
        out = dm.on_after_batch_transfer(host, 0)
        assert not [k for k in out if k.startswith("target_")]
        tokens = padded_fields(host)["tokens"].long()  # as read: not masked, not reversed or shuffled
        assert torch.equal(out["input_ids"][:, 0], tokens) and torch.equal(out["original_sequence"], tokens)


@pytest.mark.slow
def test_drop_last_drops_training_tails_only(vocab_dataset: Path) -> None:
    """drop_last=True drops each slot's short last batch in training; validation (the seed's never dropped any)
    reads the same persons as without it, still the same number of batches on every rank."""

    def persons(dm: LifeSeqDataModule, loader: str) -> list[int]:
        return [int(p) for b in getattr(dm, loader)() for p in padded_fields(b)["person_id"]]

    dropping, keeping = (LifeSeqDataModule(vocab_dataset, batch_size=9, num_workers=0, drop_last=d)
                         for d in (True, False))
    val_all = persons(keeping, "val_dataloader")
    assert len(val_all) % 9 and persons(dropping, "val_dataloader") == val_all  # a short tail, kept
    train_dropped, train_all = persons(dropping, "train_dataloader"), persons(keeping, "train_dataloader")
    assert len(train_all) % 9 and len(train_dropped) == len(train_all) // 9 * 9  # a short tail, dropped


# -- validation reads the whole val split -------------------------------------------------------------------------
def val_passes(root: Path, world: int, workers: int, batch: int) -> list[list[list[int]]]:
    """Each rank's validation through the DataModule's val_dataloader, as Lightning's rank ``r`` of ``world``
    builds it (through real DataLoader workers when workers > 0)."""
    out = []
    for rank in range(world):
        trainer = fake_trainer()
        trainer.global_rank, trainer.world_size, trainer.training = rank, world, False
        dm = LifeSeqDataModule(root, batch_size=batch, num_workers=workers, persistent_workers=False)
        dm.trainer = trainer
        out.append([padded_fields(b)["person_id"].tolist() for b in dm.val_dataloader()])
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("flags", "val_persons"), [
    (("--shards", "120", "--num-val", "200"), 200),  # 120 val shards of 1 and a remainder of 80: 120 were read
    (("--shards", "7", "--num-val", "10"), 10),  # 7 of 10 were read
    (("--shards", "4", "--val-fraction", "0.001"), 7),  # 4 of 7 were read
])
def test_validation_reads_every_val_person_once(sample: Path, tmp_path: Path, flags: tuple[str, ...],
                                                val_persons: int) -> None:
    code, out = shardify("convert", sample / "encoded_nomlm.h5", "-o", tmp_path / "ds", *flags)
    assert code == 0, out
    shards, rem = split_ids(tmp_path / "ds", "val")
    everyone = [int(i) for i in np.concatenate([*shards, rem])]
    assert len(everyone) == val_persons and len(rem), "the issue's arrangements have a val remainder"
    for world, workers in ((1, 0), (2, 2), (3, 0)):
        per_rank = val_passes(tmp_path / "ds", world, workers, 32)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == sorted(everyone), f"{world} ranks x {workers} workers"
        assert len({len(batches) for batches in per_rank}) == 1, f"unequal validation batches on {world} ranks"


def test_validation_refuses_a_arrangement_it_cannot_read_whole(sample: Path, tmp_path: Path) -> None:
    """7 val persons over 8 ranks: some rank would have no batch while the others log with sync_dist."""
    code, out = shardify("convert", sample / "encoded_nomlm.h5", "-o", tmp_path / "ds", "--shards", "4",
                         "--val-fraction", "0.001")
    assert code == 0, out
    with pytest.raises(ValueError, match=r"split val: 7 persons cannot each be read once .* on every one of 8 ranks"
                                         r".*use at most 7 ranks"):
        val_passes(tmp_path / "ds", 8, 0, 32)


# -- resume in another arrangement -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [(384, 256), (256, 384)])
def test_fit_resumed_with_another_batch_size_trains_the_rest_of_the_epoch(vocab_dataset: Path, tmp_path: Path,
                                                                          before: int, after: int) -> None:
    """trainer.fit(ckpt_path=...) of a checkpoint saved at step 3, resumed with another batch size: every person not
    trained on before once, the epoch ending at this arrangement's num_training_batches, and the OneCycleLR (over
    estimated_stepping_batches) fitted to the steps left in on_train_start. Without that fit the restored schedule
    has fewer steps than a run with a smaller batch takes, and stops it with 'Tried to step'; with a larger batch it
    does not reach its end. From 256 to 384 the rest starts at a lower batch number than the checkpoint's (the
    trainer's data fetcher counted the epoch's end from the old number, and ended it 2 batches early)."""
    import lightning.pytorch as pl

    from lifeseq_shards.model import LifeSeqPretrainModule

    class Seen(pl.Callback):
        def __init__(self) -> None:
            self.ids: list[int] = []

            self.batches = 0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.ids += batch["person_id"].tolist()
            self.batches += 1

    class WithoutTheFit(LifeSeqPretrainModule):
        def on_train_start(self) -> None:
            pass

    def fit(batch: int, module: type = LifeSeqPretrainModule, ckpt: Path | None = None) -> tuple[Any, Any, Any]:
        seen = Seen()
        # sequences cropped to 16 tokens: whole epochs of the model in seconds
        dm = LifeSeqDataModule(vocab_dataset, batch_size=batch, num_workers=0, masking=MaskingConfig(), pad_to=16)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[seen, pl.callbacks.ModelCheckpoint(tmp_path, "{step}", save_top_k=-1,
                                                                           every_n_train_steps=3)])
        model = module(EncoderConfig(16, 32, 1, 2), vocab_size=dm.vocab_size)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*resumes in another layout")
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return trainer, seen, model

    _, full, _ = fit(before)
    trained, ckpt = full.ids[: 3 * before], tmp_path / "step=3.ckpt"
    if after < before:
        with pytest.raises(ValueError, match="Tried to step"):
            fit(after, WithoutTheFit, ckpt)
    else:
        _, _, unfitted = fit(after, WithoutTheFit, ckpt)
        assert unfitted.lr_schedulers().last_epoch < unfitted.lr_schedulers().total_steps
    trainer, rest, model = fit(after, ckpt=ckpt)
    assert len(rest.ids) == len(set(rest.ids)) and not set(rest.ids) & set(trained)
    assert sorted(rest.ids + trained) == sorted(full.ids), "the rest and the trained part are the epoch"
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == trainer.num_training_batches
    scheduler = model.lr_schedulers()
    assert scheduler.last_epoch == scheduler.total_steps == trainer.estimated_stepping_batches
    # `shardify plan --resume` on the Lightning checkpoint says what the fit did
    code, out = shardify("plan", vocab_dataset, "--workers", 0, "--batch-size", after, "--resume", ckpt)
    first = trainer.num_training_batches - rest.batches
    assert (f"trained on before: {len(trained)} persons" in out and f"{rest.batches} batches per rank (all equal), "
            f"batches {first}..{trainer.num_training_batches} of this layout's epoch" in out), out
    assert code == 0 and "EXACT: nobody trained on is read again" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("save_at", [3, 6])
def test_a_checkpoint_saved_at_a_batch_end_resumes_after_that_batch(vocab_dataset: Path, tmp_path: Path,
                                                                     save_at: int) -> None:
    """ModelCheckpoint(every_n_train_steps=...) saves in on_train_batch_end, the batch's step done. The resumed fit
    trains the batches after it, with Lightning's batch indices and step count as in the uninterrupted fit. On a
    Lightning without restart stages (2.2) mid-epoch is handled and the epoch's last batch (6 of 6) refused."""
    import lightning.pytorch as pl

    from lifeseq_shards.model import LifeSeqPretrainModule

    class Recording(LifeSeqPretrainModule):
        seen: list[tuple[int, int, tuple[int, ...]]]

        def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.seen.append((self.current_epoch, batch_idx, tuple(batch["person_id"].tolist())))

    def fit(ckpt: Path | None, *callbacks: Any) -> tuple[Recording, Any]:
        dm = LifeSeqDataModule(vocab_dataset, batch_size=32, num_workers=0, masking=MaskingConfig())
        model = Recording(EncoderConfig(16, 32, 1, 2), vocab_size=dm.vocab_size)
        model.seen = []
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=6, limit_val_batches=0,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return model, trainer

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=save_at,
                                         save_top_k=-1)
    full, full_trainer = fit(None, saver)
    ckpt = tmp_path / f"step={save_at}.ckpt"
    legacy = not hasattr(full_trainer.fit_loop.epoch_loop, "restarted_on_train_batch_end")
    if legacy and save_at == 6:
        with pytest.raises(RuntimeError, match="saved at the end of an epoch's last batch"):
            fit(ckpt)
        return
    resumed, trainer = fit(ckpt)
    assert resumed.seen == full.seen[save_at:]
    assert trainer.global_step == full_trainer.global_step == 12


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fit_whose_checkpoint_cannot_resume_exactly_starts_its_epoch_over_when_asked(vocab_dataset: Path,
                                                                                      tmp_path: Path) -> None:
    """Issue 40: a Lightning checkpoint saved mid-epoch with a budget, resumed with another balance, was refused at
    the end of a long traceback telling a Lightning user to resume "without the loader's state", which Lightning
    gives no way to do. The refusal now names restart_epoch=True, and that fit trains the checkpoint's epoch from its
    first batch: every train person once, the epoch this arrangement's length."""
    import lightning.pytorch as pl

    from lifeseq_shards.model import LifeSeqPretrainModule

    class Seen(pl.Callback):
        def __init__(self) -> None:
            self.ids: list[int] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.ids += batch["person_id"].tolist()

    def fit(ckpt: Path | None = None, **kw: Any) -> tuple[Any, Seen]:
        seen = Seen()
        # sequences cropped to 16 tokens: whole epochs of the model in seconds
        dm = LifeSeqDataModule(vocab_dataset, batch_size=64, num_workers=0, masking=MaskingConfig(), pad_to=16,
                               layout="packed", tokens_per_batch=2048, **kw)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[seen, pl.callbacks.ModelCheckpoint(tmp_path, "{step}", save_top_k=-1,
                                                                           every_n_train_steps=3)])
        model = LifeSeqPretrainModule(EncoderConfig(16, 32, 1, 2), vocab_size=dm.vocab_size)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return trainer, seen

    fit()
    ckpt = tmp_path / "step=3.ckpt"
    with pytest.raises(ValueError) as refusal:
        fit(ckpt, balance="attention")
    said = str(refusal.value)
    assert "cannot resume exactly inside epoch 0" in said and "restart_epoch=True on LifeSeqDataModule" in said
    assert "\n" not in said and "without the loader's state" not in said
    with pytest.warns(UserWarning, match="epoch 0 starts over .*the 3 batches of it trained before"):
        trainer, again = fit(ckpt, balance="attention", restart_epoch=True)
    persons = read_manifest(str(vocab_dataset)).splits["train"].persons
    assert len(again.ids) == len(set(again.ids)) == persons
    assert trainer.fit_loop.epoch_loop.batch_progress.current.completed == trainer.num_training_batches
