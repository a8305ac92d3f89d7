"""The researchers' large model's sizes (D3-hparams-large.txt: BERT-base, 768/3072/12/12, max_length 1024) through
the whole path on CPU: the step-4 parquet converted with --max-seq-len 1024, LifeSeqData batches padded to 1,024
(floor(0.3 x 1024) = 307 target columns) and packed, the same masks in both layouts, and training steps of the
reference encoder at base's width on both (a tiny batch and two of its 12 layers, so the CPU runs it in seconds)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import shardify

from lifeseq_shards import LifeSeqData
from lifeseq_shards.encoder import EncoderLayer
from lifeseq_shards.masking import MaskingConfig
from lifeseq_shards.model import SIZES, LifeSeqEncoder, pretrain_losses
from lifeseq_shards.reader import World

L = 1024
SLOTS = math.floor(0.3 * L)  # 307


@pytest.fixture(scope="module")
def ds1024(sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds1024") / "ds"
    code, output = shardify("convert", sample / "sequences.parquet", "--vocab", sample / "vocab.csv", "-o", out,
                            "--max-seq-len", L)
    assert code == 0, output
    return out


def data(root: Path, layout: str, batch_size: int) -> LifeSeqData:
    return LifeSeqData(root, batch_size, num_workers=0, masking=MaskingConfig(), pad_to=L, layout=layout,
                       world=World(0, 1))


def test_conversion_records_the_1024_cap(ds1024: Path, sample: Path, tmp_path: Path) -> None:
    manifest = json.loads((ds1024 / "manifest.json").read_text())
    assert manifest["params"]["max_seq_len"] == L
    code, output = shardify("convert", sample / "sequences.parquet", "--vocab", sample / "vocab.csv", "-o",
                            tmp_path / "ds512")
    assert code == 0, output
    at_512 = json.loads((tmp_path / "ds512" / "manifest.json").read_text())["totals"]
    # a higher cap keeps every person the 512 one keeps, and never fewer tokens
    assert manifest["totals"]["persons"] >= at_512["persons"]
    assert manifest["totals"]["tokens"] >= at_512["tokens"]


def test_batches_at_1024_padded_and_packed_have_the_same_masks(ds1024: Path) -> None:
    padded = next(iter(data(ds1024, "padded", 8).train()))
    packed = next(iter(data(ds1024, "packed", 8).train()))
    assert padded["input_ids"].shape == (8, 4, L) and padded["padding_mask"].shape == (8, L)
    assert padded["target_pos"].shape == padded["target_tokens"].shape == (8, SLOTS)
    n = int(packed["lengths"].sum())
    assert packed["input_ids"].shape == (4, n) and packed["max_len"] == L
    assert packed["target_index"].shape == (8, SLOTS)
    assert torch.equal(packed["person_id"], padded["person_id"])
    assert torch.equal(packed["target_tokens"], padded["target_tokens"])
    real = padded["padding_mask"].bool()
    assert torch.equal(packed["input_ids"], padded["input_ids"].permute(1, 0, 2)[:, real])


def test_base_is_bert_base_with_tensor_core_heads() -> None:
    cfg = SIZES["base"]
    assert (cfg.hidden, cfg.ff, cfg.layers, cfg.heads) == (768, 3072, 12, 12)
    assert cfg.head_dim == 64 and cfg.hidden % 64 == 0 and cfg.ff % 64 == 0
    layer = sum(p.numel() for p in EncoderLayer(cfg, 0.0).parameters())
    assert abs(cfg.layers * layer / 85e6 - 1) < 0.01  # BERT-base's 85M encoder-layer parameters


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "batch_size"), [("packed", 2), ("padded", 1)])
def test_base_width_trains_at_1024_on_cpu(ds1024: Path, layout: str, batch_size: int) -> None:
    torch.manual_seed(0)
    run = data(ds1024, layout, batch_size)
    model = LifeSeqEncoder(dataclasses.replace(SIZES["base"], layers=2), run.vocab_size, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    batches = iter(run.train())
    first = next(batches)
    for _ in range(3):  # the same batch: its loss must fall
        mlm, cls = pretrain_losses(model, first)
        (mlm + cls).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float((mlm + cls).detach()))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    if layout == "padded":
        assert first["input_ids"].shape == (batch_size, 4, L)
