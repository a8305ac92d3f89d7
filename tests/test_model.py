"""The reference model as a working baseline: its first MLM loss is a uniform guess, and a real Trainer validates
with it and predicts CLS + mean embeddings per person, the same in the padded and packed layouts."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lifeseq_shards import LifeSeqDataModule, ShardedDataset, ShardedLoader
from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule, pretrain_losses
from lifeseq_shards.reader import World


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize("size", ["small", pytest.param("medium", marks=pytest.mark.slow)])
def test_first_mlm_loss_is_a_uniform_guess(vocab_dataset: Path, size: str) -> None:
    """ln(vocab) is the loss of a uniform guess; the decoder tied to N(0, 1) embeddings started at 41.3 (small)."""
    torch.manual_seed(0)
    ds = ShardedDataset(vocab_dataset, split="train", batch_size=64, world=World(0, 1), packed=True)
    vocab = int(ds.manifest.vocab_size)
    batch = BatchBuilder(DynamicMasker(MaskingConfig(vocab_size=vocab)))(next(iter(ShardedLoader(ds))), "cpu", 0)
    model = LifeSeqPretrainModule(size, vocab).encoder.eval()
    with torch.no_grad():
        mlm, _ = pretrain_losses(model, batch)
    assert abs(mlm.item() - math.log(vocab)) < 0.3, (mlm.item(), math.log(vocab))


@pytest.mark.slow
def test_a_trainer_validates_and_predicts_with_it(vocab_dataset: Path) -> None:
    torch.manual_seed(0)
    dm = LifeSeqDataModule(vocab_dataset, batch_size=32, num_workers=0, masking=MaskingConfig(), predict_split="val")
    model = LifeSeqPretrainModule(EncoderConfig(32, 64, 2, 4), dm.vocab_size, dropout=0.0)
    (metrics,) = _trainer().validate(model, datamodule=dm)
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] > 0
    padded = _trainer().predict(model, datamodule=dm)
    packed = _trainer().predict(model, datamodule=LifeSeqDataModule(vocab_dataset, batch_size=32, num_workers=0,
                                                                    layout="packed", predict_split="val"))
    assert [sorted(p) for p in padded] == [["cls", "mean", "person_id"]] * len(padded)
    ids = torch.cat([p["person_id"] for p in padded])
    assert len(ids) == len(set(ids.tolist())) == dm.manifest.splits["val"].persons
    for a, b in zip(padded, packed, strict=True):
        assert torch.equal(a["person_id"], b["person_id"])
        assert a["cls"].shape == a["mean"].shape == (len(a["person_id"]), 32)
        torch.testing.assert_close(a["cls"], b["cls"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a["mean"], b["mean"], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(padded[0]["cls"], padded[0]["mean"])


def test_the_mean_embedding_is_the_mean_of_the_real_tokens_states(vocab_dataset: Path) -> None:
    torch.manual_seed(0)
    ds = ShardedDataset(vocab_dataset, split="val", batch_size=16, world=World(0, 1), mode="complete", packed=True)
    model = LifeSeqPretrainModule(EncoderConfig(32, 64, 1, 4), int(ds.manifest.vocab_size)).eval()
    batch = BatchBuilder()(next(iter(ShardedLoader(ds))), "cpu", 0)
    with torch.no_grad():
        states, out = model(batch), model.predict_step(batch, 0)
    for i, n in enumerate(batch["lengths"].tolist()):
        torch.testing.assert_close(out["mean"][i], states[i, :n].mean(0))
        torch.testing.assert_close(out["cls"][i], states[i, 0])
