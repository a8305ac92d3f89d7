"""Pinned bytes: the same dataset gives the same shards, batches, masks and checkpoints as the code of 2026-12-01.

The digests were recorded by this test on commit 6f64ed9, before the reader was restructured (issue 14); a change
of behaviour (another order, another mask, another padding, another resume state) changes a digest. When a change
is meant (a new format version, a new masking rule), record the new digests in the same commit and say why there.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lifeseq_shards import ShardedDataset, ShardedLoader, compat
from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.device.batch import PackedBatch, PaddedBatch
from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.masking import DynamicMasker, MaskingConfig
from lifeseq_shards.plan.resume import Arrangement, Leg, Position
from lifeseq_shards.reader import World
from lifeseq_shards.reader.state import state_digest

# torch < 2.3 has no unsigned 16-64 bit tensors: a field stored so crosses as its signed view (the same bytes),
# which its column's dtype says; the digest names it by the dtype it stands for, as newer torch holds it
STANDS_FOR = {torch.int16: "torch.uint16", torch.int32: "torch.uint32", torch.int64: "torch.uint64"}


def digest(batches: Iterable[Any]) -> str:
    """sha256 over every batch's keys, dtypes, shapes and bytes (tensors and arrays) or repr (anything else). A host
    batch is taken as the dict it was when the digests were recorded: a packed one as its buffer, its fields'
    (name, dtype, offset, count) and its widths; a padded one as its tensors by name."""
    h = hashlib.sha256()

    def add(value: Any, signed_view: bool = False) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            h.update(f"{STANDS_FOR[value.dtype] if signed_view else value.dtype}{tuple(value.shape)}".encode())
            h.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        elif isinstance(value, np.ndarray):
            h.update(f"{value.dtype.str}{value.shape}".encode())
            h.update(np.ascontiguousarray(value).tobytes())
        elif isinstance(value, PackedBatch):
            widths = {"width": value.width}
            if value.targets_width is not None:
                widths["targets_width"] = value.targets_width
            add({"packed": value.buffer, "fields": tuple((s.name, s.dtype, s.offset, s.count) for s in value.spans),
                 **widths})
        elif isinstance(value, PaddedBatch):
            views = {c.name for c in value.columns if compat.is_view(c.dtype)}
            for k in sorted(value.tensors):
                h.update(k.encode())
                add(value.tensors[k], k in views)
        elif isinstance(value, Mapping):
            for k in sorted(value):
                h.update(k.encode())
                add(value[k])
        else:
            h.update(repr(value).encode())

    for batch in batches:
        add(batch)
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def synth_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,500 synthetic persons: 12 train shards of 114, a train remainder and a val split."""
    raw, out = tmp_path_factory.mktemp("raw"), tmp_path_factory.mktemp("ds")
    synth_population(raw, 1500, seed=7, progress=False)
    convert_dataset([str(raw / "sequences.parquet")], out, vocab=str(raw / "vocab.csv"),
                    opts=ConvertOptions(progress=False, min_shard_persons=100, val_fraction=0.05))
    return out


def with_digest(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a loader saves it since states carry a digest of their other keys (issue 40)."""
    return {**state, "digest": state_digest(state)}


def first(loader: Iterable[Any], n: int) -> list[Any]:
    return list(itertools.islice(loader, n))


def test_converted_dataset_is_pinned(synth_dataset: Path) -> None:
    ds = ShardedDataset(synth_dataset, split="train", batch_size=32, world=World(0, 1))
    assert ds.fingerprint == "22b3c1834b3b4748beb9644e359aac84"


def test_padded_batches_and_resume_state_are_pinned(synth_dataset: Path) -> None:
    ds = ShardedDataset(synth_dataset, split="train", batch_size=32, world=World(1, 2), seed=3)
    loader = ShardedLoader(ds)
    loader.set_epoch(2)
    got = first(loader, 4)
    assert digest(got) == "33779f79ac6ebfdc"
    state = loader.state_dict()
    # the state's format gained a version key (2) on 2026-12-02 and a digest of its other keys (issue 40): the rest of
    # it is the state 6f64ed9 saved
    assert state.pop("digest") == state_digest(state)
    assert state.pop("version") == 2
    assert digest([state]) == "0683e01341b4f31d"


def test_packed_batches_through_worker_rings_are_pinned(synth_dataset: Path) -> None:
    ds = ShardedDataset(synth_dataset, split="train", batch_size=16, world=World(0, 2), num_workers=2, packed=True)
    loader = ShardedLoader(ds, batches_per_message=2)
    got = first(loader, 6)
    assert digest(got) == "ab1b9724fb16bb32"
    masker = DynamicMasker(MaskingConfig(vocab_size=int(ds.manifest.vocab_size), seed=5))
    padded = [BatchBuilder(masker)(b, "cpu", epoch=1) for b in got]
    assert digest(padded) == "5a11f7d4dbd47f70"
    packed = [BatchBuilder(masker, layout="packed", max_len=64)(b, "cpu", epoch=1) for b in got]
    assert digest(packed) == "66d000db40a687f3"


def test_inference_over_all_splits_is_pinned(synth_dataset: Path) -> None:
    ds = ShardedDataset(synth_dataset, split=("train", "val"), batch_size=50, world=World(0, 3), mode="complete")
    assert digest(ShardedLoader(ds)) == "a3eebef6a26dc293"


def test_offline_mlm_batches_are_pinned(mlm_dataset: Path) -> None:
    ds = ShardedDataset(mlm_dataset, split="train", batch_size=8, world=World(0, 1), pad_to=512)
    got = first(ShardedLoader(ds), 2)
    assert digest(got) == "f306543c9e0c7330"
    assert digest([BatchBuilder("offline")(b, "cpu", epoch=0) for b in got]) == "b0976c2228b02e2d"


# The loader state the code of 6f64ed9 saved after 4 batches of the padded run above: a checkpoint of today resumes
# after a change of the reader.
SAVED_STATE = {"fingerprint": "22b3c1834b3b4748beb9644e359aac84", "split": "train", "epoch": 2, "batches": 4,
               "layout": {"split": ["train"], "world_size": 2, "num_workers": 0, "batch_size": 32, "seed": 3,
                          "mode": "train", "shuffle": True, "drop_last": False, "window": 4096,
                          "batches_per_message": 1}}


def test_a_saved_checkpoint_resumes_where_it_stopped(synth_dataset: Path) -> None:
    def make() -> ShardedLoader:
        return ShardedLoader(ShardedDataset(synth_dataset, split="train", batch_size=32, world=World(1, 2), seed=3))

    whole = make()
    whole.set_epoch(2)
    want = first(whole, 7)[4:]
    resumed = make()
    resumed.load_state_dict(SAVED_STATE)
    assert digest(first(resumed, 3)) == digest(want)


# The loader states the code of 7975264 (main before the position became one value) saved on this dataset: 3 batches
# into epoch 1 on rank 1 of 2, and 4 batches further into the rest of that epoch resumed on rank 2 of 3 at batch 16
# (its history records the first layout). A checkpoint of that code resumes exactly, and this code saves the same,
# with the version key (2) states hold since 2026-12-02.
TODAY_STATE = {"fingerprint": "22b3c1834b3b4748beb9644e359aac84", "split": "train", "epoch": 1, "batches": 3,
               "layout": {"split": ["train"], "world_size": 2, "num_workers": 0, "batch_size": 32, "seed": 3,
                          "mode": "train", "shuffle": True, "drop_last": False, "window": 4096,
                          "batches_per_message": 1}}
TODAY_REST_STATE = {"fingerprint": "22b3c1834b3b4748beb9644e359aac84", "split": "train", "epoch": 1, "batches": 8,
                    "history": [{"world_size": 2, "num_workers": 0, "batch_size": 32, "drop_last": False,
                                 "window": 4096, "batches_per_message": 1, "batches": 3}],
                    "layout": {"split": ["train"], "world_size": 3, "num_workers": 0, "batch_size": 16, "seed": 3,
                               "mode": "train", "shuffle": True, "drop_last": False, "window": 4096,
                               "batches_per_message": 1}}


def test_checkpoints_of_the_code_before_resume_exactly(synth_dataset: Path) -> None:
    def make(world: int, rank: int, batch_size: int) -> ShardedLoader:
        ds = ShardedDataset(synth_dataset, split="train", batch_size=batch_size, world=World(rank, world), seed=3)
        return ShardedLoader(ds)

    whole = make(2, 1, 32)
    whole.set_epoch(1)
    batches = iter(whole)
    first(batches, 3)
    assert whole.state_dict() == with_digest({**TODAY_STATE, "version": 2})
    want = first(batches, 4)
    resumed = make(2, 1, 32)
    resumed.load_state_dict(TODAY_STATE)
    assert resumed.position == Position(1, 3)
    assert digest(first(resumed, 4)) == digest(want)

    rest = make(3, 2, 16)
    with pytest.warns(UserWarning, match="epoch 1 resumes in another layout"):
        rest.load_state_dict(TODAY_STATE)
    stage = Leg(Arrangement(2, 0, 32, False, 4096, 1), 3)
    assert rest.position == Position(1, 4, (stage,))  # the rest of the epoch starts at batch 4 of this layout's
    batches = iter(rest)
    first(batches, 4)
    assert rest.state_dict() == with_digest({**TODAY_REST_STATE, "version": 2})
    want = first(batches, 3)
    again = make(3, 2, 16)
    again.load_state_dict(TODAY_REST_STATE)
    assert again.position == Position(1, 8, (stage,))
    assert digest(first(again, 3)) == digest(want)
