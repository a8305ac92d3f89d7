"""A checkpoint saved by the code before the package was split into subpackages (522a389) still loads and resumes:
the module paths it pickles (``lifeseq_shards.encoder.EncoderConfig`` in the module's hparams) did not move, and the
DataModule's loader state continues the epoch where it stopped.

tests/data/ckpt-before-layout-{newest,pinned}.ckpt were saved by 522a389 on each stack (lightning 2.6.6 + torch
2.13; the researchers' lightning 2.2.2 + torch 2.1.2): the reference module with a tiny ``EncoderConfig`` and
dynamic masking, on the sample's ``encoded_nomlm.h5`` converted with the vocabulary in 4 shards, batch 64, no
workers, at step 3 of a 4-step fit. Each stack loads both."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

from lifeseq_shards import LifeSeqDataModule
from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.masking import MaskingConfig
from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule

DATA = Path(__file__).parent / "data"
CKPTS = [DATA / "ckpt-before-layout-newest.ckpt", DATA / "ckpt-before-layout-pinned.ckpt"]
SAVED_AT = 3  # the step the checkpoint was saved at
STEPS = 6


class PersonsSeen(L.Callback):
    """The person ids of every training batch, in order."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, idx: int) -> None:
        self.batches.append(batch["person_id"].tolist())  # type: ignore[index]


def _fit(ds: Path, ckpt: Path | None) -> tuple[PersonsSeen, LifeSeqPretrainModule]:
    torch.manual_seed(0)
    dm = LifeSeqDataModule(ds, batch_size=64, num_workers=0, masking=MaskingConfig(), persistent_workers=False)
    model = LifeSeqPretrainModule(EncoderConfig(hidden=16, ff=32, layers=1, heads=2), dm.vocab_size)
    seen = PersonsSeen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[seen], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_model_summary=False)
    trainer.fit(model, dm, ckpt_path=str(ckpt) if ckpt else None, **_full_unpickler(trainer.fit))
    return seen, model


def _full_unpickler(load: Callable[..., object]) -> dict[str, bool]:
    """Lightning >= 2.4 takes weights_only; the checkpoint's optimizer state needs the full unpickler there."""
    return {"weights_only": False} if "weights_only" in inspect.signature(load).parameters else {}


@pytest.fixture(scope="module")
def dataset(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    convert_dataset([str(sample / "encoded_nomlm.h5")], out, str(sample / "vocab.csv"),
                    opts=ConvertOptions(progress=False, shards=4))
    return out


@pytest.mark.parametrize("ckpt", CKPTS, ids=["newest", "pinned"])
def test_the_hparams_config_unpickles_at_its_old_path(ckpt: Path) -> None:
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    size = saved["hyper_parameters"]["size"]
    assert type(size) is EncoderConfig and type(size).__module__ == "lifeseq_shards.encoder"
    assert size == EncoderConfig(hidden=16, ff=32, layers=1, heads=2)
    model = LifeSeqPretrainModule.load_from_checkpoint(ckpt, map_location="cpu",
                                                       **_full_unpickler(LifeSeqPretrainModule.load_from_checkpoint))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["state_dict"][name]), name


@pytest.fixture(scope="module")
def uninterrupted(dataset: Path) -> PersonsSeen:
    seen, _ = _fit(dataset, None)
    assert len(seen.batches) == STEPS
    return seen


@pytest.mark.parametrize("ckpt", CKPTS, ids=["newest", "pinned"])
def test_a_checkpoint_of_the_old_layout_resumes_where_it_stopped(dataset: Path, uninterrupted: PersonsSeen,
                                                                 ckpt: Path) -> None:
    """The resumed fit trains the batches the uninterrupted fit trains after step 3, and no others."""
    resumed, _ = _fit(dataset, ckpt)
    assert resumed.batches == uninterrupted.batches[SAVED_AT:]
