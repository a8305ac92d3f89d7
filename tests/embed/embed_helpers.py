"""What the embedding tests share: the model every process builds alike, a plain-loop embedding job, a copy of a
finished output to damage, and the CLI's verify (the fixtures are in conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from helpers import shardify

from lifeseq_shards import EmbeddingWriter, ShardedLoader
from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.model import EncoderConfig, LifeSeqPretrainModule
from lifeseq_shards.reader import World
from lifeseq_shards.store.remote import read_manifest


def model_for(root: Path) -> LifeSeqPretrainModule:
    """The model of tests/ddp_scripts/embed_predict.py: the same weights in every process."""
    torch.manual_seed(0)
    return LifeSeqPretrainModule(EncoderConfig(16, 32, 1, 2), int(read_manifest(root).vocab_size), dropout=0.0).eval()


def embed_in_process(root: Path, out: Path, dtype: str = "float32", batch_size: int = 64,
                     model: LifeSeqPretrainModule | None = None, padding: str = "padded") -> EmbeddingWriter:
    """The plain loop of docs/reference/ddp.md: one process, no Trainer (``model``: model_for's by default;
    ``padding``: what the writer records)."""
    model = model_for(root) if model is None else model
    writer = EmbeddingWriter(out, dtype=dtype, padding=padding)
    dataset = writer.dataset(root, batch_size=batch_size, model=model, world=World(0, 1))
    builder = BatchBuilder()
    with torch.no_grad():
        for i, batch in enumerate(ShardedLoader(dataset)):
            model_batch = builder(batch, "cpu", 0)
            writer.write(model.predict_step(model_batch, i), model_batch)
    writer.finish()
    return writer


def broken_copy(done: Path, tmp_path: Path) -> Path:
    out = tmp_path / "emb"
    shutil.copytree(done, out)
    return out


def verify(out: Path, ds: Path) -> tuple[int, str]:
    return shardify("embeddings", "verify", out, "--data", ds)
