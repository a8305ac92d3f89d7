"""Host -> device transfer keeps the narrow dtypes; seed_batch widens them into the seed's batch, without a sync."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lifeseq_shards.device import host_sync_guard, seed_batch, to_device
from lifeseq_shards.masking import DynamicMasker, MaskingConfig


def _tiny_batch() -> dict[str, np.ndarray]:
    """Two persons with values at the edges of their narrow dtypes (uint16 65535 reads as int16 -1 if misread)."""
    tokens = np.array([[1, 65535, 2, 70, 2, 0, 0, 0], [1, 6, 2, 7, 8, 2, 9, 2]], dtype=np.uint16)
    return {
        "person_id": np.array([2**40 + 1, -5], dtype=np.int64),
        "lengths": np.array([5, 8], dtype=np.int32),
        "tokens": tokens,
        "abspos": np.array([[0, 0, 0, -300, -300, 0, 0, 0], [0, 0, 0, 32767, 32767, 32767, 9, 9]], dtype=np.int16),
        "age": np.full((2, 8), 255, dtype=np.uint8) * (tokens > 0),
        "segment": np.full((2, 8), 2, dtype=np.uint8) * (tokens > 0),
    }


def test_to_device_keeps_the_narrow_dtypes() -> None:
    host = _tiny_batch()
    moved = to_device(host, "cpu")
    assert set(moved) == set(host)
    for k, v in host.items():
        assert moved[k].dtype == torch.from_numpy(v).dtype and moved[k].numpy().tolist() == v.tolist(), k
    again = to_device(moved, torch.device("cpu"), non_blocking=False)  # tensors in, too
    assert all(torch.equal(again[k], moved[k]) for k in moved)


def test_seed_batch_widens_without_losing_values() -> None:
    host = _tiny_batch()
    out = seed_batch(to_device(host, "cpu"))
    assert set(out) == {"person_id", "lengths", "padding_mask", "input_ids", "original_sequence"}  # no targets
    assert out["input_ids"].dtype == out["padding_mask"].dtype == out["original_sequence"].dtype == torch.int64
    assert out["input_ids"].shape == (2, 4, 8)
    for r, k in enumerate(("tokens", "abspos", "age", "segment")):
        assert out["input_ids"][:, r].tolist() == host[k].astype(np.int64).tolist(), k
    assert out["input_ids"][0, 0, 1] == 65535 and out["input_ids"][0, 1, 3] == -300
    assert out["padding_mask"].tolist() == [[1] * 5 + [0] * 3, [1] * 8]
    assert out["original_sequence"].tolist() == host["tokens"].astype(np.int64).tolist()
    assert out["person_id"].tolist() == [2**40 + 1, -5] and out["lengths"].dtype == torch.int32


def _offline_batch(sample: Path, rows: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The reader's host batch for the first ``rows`` persons of encoded_mlm.h5 (narrow, L and T as in CONTEXT)."""
    import h5py

    with h5py.File(sample / "encoded_mlm.h5") as f:
        h5 = {k: f[k][:rows] for k in f}
    lengths = h5["padding_mask"].sum(1)
    L = int(-(-lengths.max() // 8) * 8)
    n = (h5["target_pos"][:, :153] != 511).sum(1)
    T = int(n.max())
    ids = h5["input_ids"][:, :, :L]
    host = {
        "person_id": h5["sequence_id"],
        "lengths": lengths.astype(np.int32),
        "tokens": h5["original_sequence"][:, :L].astype(np.uint16),
        "abspos": ids[:, 1].astype(np.int16),
        "age": ids[:, 2].astype(np.uint8),
        "segment": ids[:, 3].astype(np.uint8),
        "masked_tokens": ids[:, 0].astype(np.uint16),
        "target_pos": np.where(np.arange(T) < n[:, None], h5["target_pos"][:, :T], 0).astype(np.uint16),
        "target_tokens": np.where(np.arange(T) < n[:, None], h5["target_tokens"][:, :T], 0).astype(np.uint16),
        "n_targets": n.astype(np.uint16),
        "target_cls": h5["target_cls"].astype(np.uint8),
    }
    return host, h5


def test_offline_fields_rebuild_the_seed_batch(sample: Path) -> None:
    host, h5 = _offline_batch(sample, 200)
    L = host["tokens"].shape[1]
    with host_sync_guard():
        out = seed_batch(to_device(host, "cpu"))
    assert torch.equal(out["input_ids"], torch.from_numpy(h5["input_ids"][:, :, :L]))
    assert torch.equal(out["padding_mask"], torch.from_numpy(h5["padding_mask"][:, :L]))
    assert torch.equal(out["original_sequence"], torch.from_numpy(h5["original_sequence"][:, :L]))
    assert torch.equal(out["target_cls"], torch.from_numpy(h5["target_cls"]))
    T = math.floor(0.3 * L)
    assert out["target_pos"].shape == out["target_tokens"].shape == (200, T)
    seed_pos, seed_tok = h5["target_pos"][:, :T], h5["target_tokens"][:, :T]
    # the seed pads to 153 slots with position 511; we pad to floor(0.3 L) slots with position L-1
    assert np.array_equal(out["target_pos"].numpy(), np.where(seed_pos == 511, L - 1, seed_pos))
    assert np.array_equal(out["target_tokens"].numpy(), seed_tok)
    assert all(out[k].dtype == torch.int64 for k in ("target_pos", "target_tokens", "target_cls"))


def test_offline_targets_beyond_the_default_share_are_kept() -> None:
    host = _tiny_batch()
    host |= {
        "masked_tokens": host["tokens"],
        "target_pos": np.array([[1, 3, 0], [3, 4, 6]], dtype=np.uint16),  # 3 > floor(0.3 * 8) = 2 slots
        "target_tokens": np.array([[65535, 70, 0], [7, 8, 9]], dtype=np.uint16),
        "n_targets": np.array([2, 3], dtype=np.uint16),
        "target_cls": np.array([0, 2], dtype=np.uint8),
    }
    out = seed_batch(to_device(host, "cpu"))
    assert out["target_pos"].tolist() == [[1, 3, 7], [3, 4, 6]]
    cropped = seed_batch(
        {
            k: (v[:, :5] if k in ("tokens", "abspos", "age", "segment", "masked_tokens") else v)
            for k, v in to_device(host, "cpu").items()
        }
    )  # pad_to=5 cut person 1 after 5 tokens
    assert cropped["target_pos"].tolist() == [[1, 3, 4], [3, 4, 4]]  # position 6 is gone: slot unused, not kept
    assert cropped["target_tokens"].tolist() == [[65535, 70, 0], [7, 8, 0]]
    assert out["target_tokens"].tolist() == [[65535, 70, 0], [7, 8, 9]]
    assert out["target_cls"].tolist() == [0, 2]


@pytest.mark.parametrize("kind", ["random", "event"])
def test_dynamic_masks_replace_the_offline_ones(sample: Path, kind: str) -> None:
    host, _ = _offline_batch(sample, 64)
    batch = to_device(host, "cpu")
    masker = DynamicMasker(MaskingConfig(vocab_size=2970, kind=kind, p_reverse=0.2, p_shuffle=0.2))
    with host_sync_guard():
        out = seed_batch(batch, masker, epoch=1)
    direct = masker(*(batch[k] for k in ("tokens", "abspos", "age", "segment", "lengths", "person_id")), 1)
    L = host["tokens"].shape[1]
    assert out["input_ids"].shape == (64, 4, L) and out["target_pos"].shape == (64, math.floor(0.3 * L))
    assert torch.equal(out["input_ids"][:, 0], direct["masked_tokens"])
    for r, k in enumerate(("abspos", "age", "segment"), start=1):
        assert torch.equal(out["input_ids"][:, r], direct[k])
    assert torch.equal(out["original_sequence"], direct["original"])
    assert all(torch.equal(out[k], direct[k]) for k in ("target_pos", "target_tokens", "target_cls"))
    assert not torch.equal(out["input_ids"][:, 0], batch["masked_tokens"].long())  # the offline masks were not used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_transfer_and_widening() -> None:
    host = {k: torch.from_numpy(v).pin_memory() for k, v in _tiny_batch().items()}
    moved = to_device(host, "cuda")
    assert all(moved[k].is_cuda and moved[k].dtype == host[k].dtype for k in host)
    masker = DynamicMasker(MaskingConfig(vocab_size=2**16))
    with host_sync_guard():
        gpu = seed_batch(moved, masker, epoch=2)
    cpu = seed_batch(host, masker, epoch=2)
    assert all(torch.equal(gpu[k].cpu(), cpu[k]) for k in cpu)


@pytest.mark.parametrize("fixture", ["mlm_dataset", "nomlm_dataset"])
def test_packed_batches_unpack_to_the_padded_ones(fixture: str, request: pytest.FixtureRequest) -> None:
    """Only real tokens cross the bus; the device pads them back, equal to the host-padded batch, without a sync."""
    from lifeseq_shards.device import split_packed, unpack
    from lifeseq_shards.reader import ShardedDataset

    root = request.getfixturevalue(fixture)
    padded = ShardedDataset(root, "train", batch_size=48, seed=5)
    packed = ShardedDataset(root, "train", batch_size=48, seed=5, packed=True)
    n = 0
    for host, compact in zip(padded, packed, strict=True):
        buffers = [v for v in compact.values() if isinstance(v, (np.ndarray, torch.Tensor))]
        assert len(buffers) == 1 and buffers[0].nbytes < sum(v.nbytes for v in host.values())
        assert split_packed(compact)["tokens"].shape == (int(host["lengths"].sum()),)
        moved = to_device(compact, "cpu")
        with host_sync_guard():
            wide = unpack(moved)
            seed_from_packed = seed_batch(moved)
        assert set(wide) == set(host)
        for k, v in host.items():
            assert wide[k].dtype == v.dtype and torch.equal(wide[k], v), k
        for k, v in seed_batch(host).items():
            assert torch.equal(seed_from_packed[k], v), k
        n += 1
    assert n == len(padded)
