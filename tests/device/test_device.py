"""Host -> device transfer keeps the narrow dtypes; model_batch widens them into the seed's batch, without a sync."""

from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lifeseq_shards import compat
from lifeseq_shards.device.batch import Column, PackedBatch, PackedModelBatch, PaddedBatch
from lifeseq_shards.device.build import (
    BatchBuilder,
    count_tokens,
    host_sync_guard,
    model_batch,
    packed_views,
    padded_fields,
    to_device,
)
from lifeseq_shards.device.prefetch import OFF, STREAM, THREAD, DevicePrefetcher
from lifeseq_shards.device.shape import PACKED
from lifeseq_shards.masking import EAGER, GRAPHED, DynamicMasker, MaskingConfig
from lifeseq_shards.store.format import RAGGED, SCALAR, TARGETS

# the kinds of the fields a host batch may hold, by name (a padded host batch's per-token fields are all ragged)
_KINDS = {"person_id": SCALAR, "lengths": SCALAR, "n_targets": SCALAR, "target_cls": SCALAR, "target_pos": TARGETS,
          "target_tokens": TARGETS}


def _host(arrays: dict[str, np.ndarray]) -> PaddedBatch:
    """A padded host batch of ``arrays``, as the reader's collate_padded makes it (through compat.to_tensor)."""
    return PaddedBatch({k: compat.to_tensor(np.ascontiguousarray(v)) for k, v in arrays.items()},
                       tuple(Column(k, v.dtype.str, _KINDS.get(k, RAGGED)) for k, v in arrays.items()))


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
    moved = to_device(_host(host), "cpu")
    views = set() if compat.unsigned_tensors() else {"tokens"}  # torch < 2.3: uint16 crosses as its int16 view
    assert isinstance(moved, PaddedBatch) and {c.name for c in moved.columns if compat.is_view(c.dtype)} == views
    assert set(moved.tensors) == set(host)
    for k, v in host.items():
        t = moved.tensors[k]
        assert t.dtype == compat.torch_dtype(v.dtype) and t.numpy().tobytes() == v.tobytes(), k
    again = to_device(moved, torch.device("cpu"), non_blocking=False)  # tensors in, too
    assert again.columns == moved.columns and all(torch.equal(again.tensors[k], moved.tensors[k]) for k in host)


@pytest.mark.parametrize("old", ["seed_batch", "split_packed", "unpack", "DevicePrefetcher"])
def test_old_names_are_gone(old: str) -> None:
    """The names before issue 14 (now model_batch, packed_views, padded_fields, prefetch.DevicePrefetcher) fail
    as any missing name does, in both import forms."""
    from lifeseq_shards.device import build as device

    with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
        getattr(device, old)
    with pytest.raises(ImportError, match=f"cannot import name '{old}'"):
        exec(f"from lifeseq_shards.device.build import {old}")


def test_seed_batch_widens_without_losing_values() -> None:
    host = _tiny_batch()
    out = model_batch(to_device(_host(host), "cpu"))
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
        out = model_batch(to_device(_host(host), "cpu"))
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
    out = model_batch(to_device(_host(host), "cpu"))
    assert out["target_pos"].tolist() == [[1, 3, 7], [3, 4, 6]]
    cropped = model_batch(
        _host({k: (v[:, :5] if k in ("tokens", "abspos", "age", "segment", "masked_tokens") else v)
               for k, v in host.items()})
    )  # pad_to=5 cut person 1 after 5 tokens
    assert cropped["target_pos"].tolist() == [[1, 3, 4], [3, 4, 4]]  # position 6 is gone: slot unused, not kept
    assert cropped["target_tokens"].tolist() == [[65535, 70, 0], [7, 8, 0]]
    assert out["target_tokens"].tolist() == [[65535, 70, 0], [7, 8, 9]]
    assert out["target_cls"].tolist() == [0, 2]


@pytest.mark.parametrize("kind", ["random", "event"])
def test_dynamic_masks_replace_the_offline_ones(sample: Path, kind: str) -> None:
    host, _ = _offline_batch(sample, 64)
    batch = to_device(_host(host), "cpu")
    masker = DynamicMasker(MaskingConfig(vocab_size=2970, kind=kind, p_reverse=0.2, p_shuffle=0.2))
    with host_sync_guard():
        out = model_batch(batch, masker, epoch=1)
    fields = batch.widened()
    direct = masker(*(fields[k] for k in ("tokens", "abspos", "age", "segment", "lengths", "person_id")), 1)
    L = host["tokens"].shape[1]
    assert out["input_ids"].shape == (64, 4, L) and out["target_pos"].shape == (64, math.floor(0.3 * L))
    assert torch.equal(out["input_ids"][:, 0], direct["masked_tokens"])
    for r, k in enumerate(("abspos", "age", "segment"), start=1):
        assert torch.equal(out["input_ids"][:, r], direct[k])
    assert torch.equal(out["original_sequence"], direct["original"])
    assert all(torch.equal(out[k], direct[k]) for k in ("target_pos", "target_tokens", "target_cls"))
    assert not torch.equal(out["input_ids"][:, 0], fields["masked_tokens"].long())  # the offline masks were not used


@pytest.mark.cuda
def test_cuda_transfer_and_widening() -> None:
    host = _host(_tiny_batch()).pin_memory()
    assert all(t.is_pinned() for t in host.tensors.values())
    moved = to_device(host, "cuda")
    assert all(moved.tensors[k].is_cuda and moved.tensors[k].dtype == t.dtype for k, t in host.tensors.items())
    masker = DynamicMasker(MaskingConfig(vocab_size=2**16))
    with host_sync_guard():
        gpu = model_batch(moved, masker, epoch=2)
    cpu = model_batch(host, masker, epoch=2)
    assert all(torch.equal(gpu[k].cpu(), cpu[k]) for k in cpu)


@pytest.mark.parametrize("fixture", ["mlm_dataset", "nomlm_dataset"])
def test_packed_batches_unpack_to_the_padded_ones(fixture: str, request: pytest.FixtureRequest) -> None:
    """Only real tokens cross the bus; the device pads them back, equal to the host-padded batch, without a sync."""
    from lifeseq_shards.reader import ShardedDataset

    root = request.getfixturevalue(fixture)
    padded = ShardedDataset(root, split="train", batch_size=48, seed=5)
    packed = ShardedDataset(root, split="train", batch_size=48, seed=5, packed=True)
    n = 0
    for host, compact in zip(padded, packed, strict=True):
        assert isinstance(compact, PackedBatch) and isinstance(host, PaddedBatch)
        host_bytes = sum(v.nbytes for v in host.tensors.values())
        assert isinstance(compact.buffer, np.ndarray) and compact.buffer.nbytes < host_bytes  # one buffer, smaller
        assert packed_views(compact)["tokens"].shape == (int(host.tensors["lengths"].sum()),)
        moved = to_device(compact, "cpu")
        with host_sync_guard():
            wide = padded_fields(moved)
            model_from_packed = model_batch(moved)
        want = padded_fields(host)  # the host batch itself, but for signed views read back (torch < 2.3)
        assert set(wide) == set(want)
        for k, v in want.items():
            assert wide[k].dtype == v.dtype and torch.equal(wide[k], v), k
        for k, v in model_batch(host).items():
            assert torch.equal(model_from_packed[k], v), k
        n += 1
    assert n == len(padded)


def _person(batch: dict[str, torch.Tensor], i: int) -> dict[str, list]:
    """Person ``i`` of a model batch of either layout, as plain lists: its tokens and stamps as the model sees them,
    its MLM targets (position in the person, token) in slot order, and its CLS target."""
    n = int(batch["lengths"][i])
    if isinstance(batch, PackedModelBatch):
        start = int(batch["cu_seqlens"][i])
        assert int(batch["cu_seqlens"][i + 1]) - start == n
        ids, orig = batch["input_ids"][:, start : start + n], batch["original_sequence"][start : start + n]
        pos = batch["target_index"][i] - start
    else:
        assert batch["padding_mask"][i].tolist() == [1] * n + [0] * (batch["padding_mask"].shape[1] - n)
        ids, orig, pos = batch["input_ids"][i, :, :n], batch["original_sequence"][i, :n], batch["target_pos"][i]
    used = batch["target_tokens"][i] != 0
    return {"ids": ids.tolist(), "orig": orig.tolist(), "targets": list(zip(pos[used].tolist(),
            batch["target_tokens"][i][used].tolist(), strict=True)), "cls": int(batch["target_cls"][i])}


@pytest.mark.parametrize("kind", ["random", "event"])
def test_packed_layout_has_the_padded_masks(nomlm_dataset: Path, kind: str) -> None:
    """The packed layout (cropped on the device to max_len) against the padded path the sweep runs (the reader's
    pad_to crop): for every person the same tokens, stamps, masks, targets (as rows of the packed array) and CLS
    task; only the real tokens are kept, and no host sync happens on the device side."""
    from lifeseq_shards.reader import ShardedDataset

    L = 64  # below the longest persons of the sample: some are cropped
    masker = DynamicMasker(MaskingConfig(vocab_size=2970, kind=kind, p_reverse=0.3, p_shuffle=0.3, seed=3))
    padded = ShardedDataset(nomlm_dataset, split="train", batch_size=32, seed=2, pad_to=L)
    packed = ShardedDataset(nomlm_dataset, split="train", batch_size=32, seed=2, packed=True)
    cropped = 0
    for i, (host_padded, host_packed) in enumerate(zip(padded, packed, strict=True)):
        counted = count_tokens(host_packed, L)
        with host_sync_guard():
            want = model_batch(to_device(host_padded, "cpu"), masker, epoch=1)
            got = model_batch(to_device(counted, "cpu"), masker, epoch=1, layout="packed", max_len=L)
        assert got["input_ids"].shape == (4, int(want["padding_mask"].sum())) and got["max_len"] == L
        assert got["target_index"].shape == want["target_pos"].shape and "padding_mask" not in got
        assert torch.equal(got["lengths"].long(), want["lengths"].long())
        for j in range(len(got["lengths"])):
            assert _person(got, j) == _person(want, j)
        cropped += int((packed_views(host_packed)["lengths"] > L).sum())
        if i == 3:
            break
    assert cropped > 0


class _Counting:
    """A loader that counts how many host batches were taken from it, and keeps the position the prefetcher reports
    handed out (as ShardedLoader's ``positioned`` / ``handed``)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.taken, self.position = batches, 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def positioned(self):
        for b in self.batches:
            self.taken += 1
            yield b, self.taken

    def handed(self, position: int) -> None:
        self.position = position

    def state_dict(self, epoch_batches: int | None = None, unfinished: int = 0) -> dict:
        return {"taken": self.position - unfinished}  # as ShardedLoader: batches handed out

    def load_state_dict(self, state: dict) -> None:
        self.taken = self.position = state["taken"]


def _prefetch_case(dataset: Path, device: str, graph: bool = False) -> tuple[list, BatchBuilder]:
    from lifeseq_shards.reader import ShardedDataset

    hosts = list(ShardedDataset(dataset, split="train", batch_size=40, seed=4, packed=True))[:4]
    if device == "cuda":
        hosts = [h.with_buffer(torch.from_numpy(h.buffer)).pin_memory() for h in hosts]
    return hosts, _prefetch_builder(graph)


def _prefetch_builder(graph: bool = False) -> BatchBuilder:
    return BatchBuilder(DynamicMasker(MaskingConfig(vocab_size=2970, p_reverse=0.3, p_shuffle=0.3),
                                      GRAPHED if graph else EAGER),
                        PACKED, 48)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prefetch_changes_nothing_in_the_batches(nomlm_dataset: Path, device: str, threaded: bool,
                                                 graph: bool) -> None:
    """The same batches as built directly with the eager masker; with ``graph`` the prefetcher's masker replays CUDA
    graphs (captured in the prefetch thread when threaded, eager off CUDA)."""
    hosts, builder = _prefetch_case(nomlm_dataset, device, graph)
    direct = [_prefetch_builder()(h, device, 2) for h in hosts]
    loader = _Counting(hosts)
    prefetcher = DevicePrefetcher(loader, lambda h: builder(h, device, 2), device, THREAD if threaded else STREAM)
    assert len(prefetcher) == 4 and prefetcher.state_dict() == {"taken": 0}  # the loader's own attributes
    seen = []
    for i, batch in enumerate(prefetcher):
        if threaded:  # the thread runs up to two batches ahead, at its own pace
            assert i + 1 <= loader.taken <= min(i + 3, 4)
        else:
            assert loader.taken == min(i + 2, 4)  # one batch ahead of the step
        assert prefetcher.state_dict() == {"taken": i + 1}  # a checkpoint now resumes after batch i, not i + 1
        seen.append(batch)
    assert len(seen) == len(direct)
    prefetcher.load_state_dict({"taken": 1})
    assert prefetcher.state_dict() == {"taken": 1} and loader.taken == 1  # the loader's, not the last iteration's
    for got, want in zip(seen, direct, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k], k


def test_prefetcher_forwards_lightnings_loader_attributes_by_name(nomlm_dataset: Path) -> None:
    """What Lightning reads and resets on a train loader is the wrapped loader's, writes included (its shutdown of
    the workers drops the loader's iterator, as for a bare loader); any other attribute is the prefetcher's own: the
    loader's others are not forwarded (AttributeError)."""
    from lifeseq_shards.reader import ShardedDataset, ShardedLoader

    loader = ShardedLoader(ShardedDataset(nomlm_dataset, split="train", batch_size=40, seed=4, packed=True))
    prefetcher = DevicePrefetcher(loader, lambda h: h, "cpu")
    assert prefetcher.dataset is loader.dataset and prefetcher.sampler is loader.sampler
    assert prefetcher.batch_sampler is loader.batch_sampler and prefetcher.worker_init_fn is None
    assert prefetcher._iterator is loader._iterator
    prefetcher._iterator = None  # what lightning's _shutdown_workers_and_reset_iterator does at the end of a fit
    prefetcher.worker_init_fn = print  # what lightning does under PL_SEED_WORKERS
    assert loader._iterator is None and loader.worker_init_fn is print
    assert not {"_iterator", "worker_init_fn"} & set(vars(prefetcher))
    assert hasattr(loader, "pin_memory")
    with pytest.raises(AttributeError, match="'DevicePrefetcher' object has no attribute 'pin_memory'"):
        prefetcher.pin_memory  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not hasattr(DevicePrefetcher([], lambda h: h, "cpu"), "dataset")  # a plain iterable has none


def test_threaded_prefetch_stops_its_thread_and_raises_its_errors(nomlm_dataset: Path) -> None:
    hosts, builder = _prefetch_case(nomlm_dataset, "cpu")
    before = threading.active_count()
    prefetcher = DevicePrefetcher(_Counting(hosts * 50), lambda h: builder(h, "cpu", 2), "cpu", THREAD)
    batches = iter(prefetcher)
    for _ in range(3):
        next(batches)
    assert threading.active_count() == before + 1
    batches.close()  # Lightning's max_steps: the iteration ends with the loader far from done
    assert threading.active_count() == before

    def broken(_host: dict) -> dict:
        raise OSError("a shard went missing")

    with pytest.raises(OSError, match="went missing"):
        list(DevicePrefetcher(_Counting(hosts), broken, "cpu", THREAD))
    assert threading.active_count() == before


def test_datamodule_prefetch_and_layout_options(nomlm_dataset: Path) -> None:
    """prefetch="stream" (or True) hands the model batches already built (the hooks pass them through), "thread" too;
    the same batches as the hooks build from the plain loader's host batches ("off", or False)."""
    from lifeseq_shards.datamodule import LifeSeqDataModule

    def batches(prefetch: str | bool, want: str) -> list[dict]:
        dm = LifeSeqDataModule(nomlm_dataset, 40, num_workers=0, seed=1, pad_to=48, layout="packed",
                               masking=MaskingConfig(vocab_size=2970), prefetch=prefetch)
        loader = dm.train_dataloader()
        assert isinstance(loader, DevicePrefetcher) == (want != OFF)
        assert getattr(loader, "prefetch", OFF) == want  # the DataModule's option
        out = []
        for b, _ in zip(loader, range(3), strict=False):
            out.append(dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, torch.device("cpu"), 0), 0))
        return out

    assert batches(True, STREAM) and batches(False, OFF)  # the guides' words
    plain, ahead, in_thread = batches(OFF, OFF), batches(STREAM, STREAM), batches(THREAD, THREAD)
    assert len(plain) == len(ahead) == len(in_thread) == 3
    for a, b, c in zip(plain, ahead, in_thread, strict=True):
        assert isinstance(a, PackedModelBatch) and a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
        assert all(torch.equal(a[k], c[k]) if isinstance(a[k], torch.Tensor) else a[k] == c[k] for k in a)


def test_packed_layout_refuses_to_crop_offline_targets(mlm_dataset: Path) -> None:
    from lifeseq_shards.datamodule import LifeSeqDataModule

    with pytest.raises(ValueError, match="offline MLM targets"):
        LifeSeqDataModule(mlm_dataset, 8, num_workers=0, masking="offline", layout="packed", pad_to=64)
    LifeSeqDataModule(mlm_dataset, 8, num_workers=0, masking="offline", layout="packed")  # no crop: fine


def test_packed_layout_carries_the_offline_masks(mlm_dataset: Path) -> None:
    """Offline masks (encoded_mlm.h5's) in the packed layout: the same per person as the padded model batch."""
    from lifeseq_shards.reader import ShardedDataset

    for i, host in enumerate(ShardedDataset(mlm_dataset, split="train", batch_size=32, seed=1, packed=True)):
        counted = count_tokens(host)
        with host_sync_guard():
            want = model_batch(to_device(host, "cpu"))
            got = model_batch(to_device(counted, "cpu"), layout=PACKED)
        assert got["target_index"].shape == want["target_pos"].shape
        assert all(_person(got, j) == _person(want, j) for j in range(len(got["lengths"])))
        if i == 2:
            break


@pytest.mark.parametrize("layout", ["padded", PACKED])
def test_no_masking_drops_the_offline_masks_of_packed_batches(mlm_dataset: Path, layout: str) -> None:
    """``masking=None`` on an offline-MLM dataset: the model sees the stored sequences, no [MASK] and no targets,
    whether the host batch is padded (pad_to) or packed (the DataModule's default, where the offline fields live in
    the buffer, not as keys of the batch)."""
    from lifeseq_shards.reader import ShardedDataset

    padded = ShardedDataset(mlm_dataset, split="train", batch_size=16, seed=1, pad_to=512)
    packed = ShardedDataset(mlm_dataset, split="train", batch_size=16, seed=1, packed=True)
    for i, (host_padded, host_packed) in enumerate(zip(padded, packed, strict=True)):
        want = BatchBuilder(None)(host_padded, "cpu", 0)
        got = BatchBuilder(None, layout)(host_packed, "cpu", 0)
        assert not {"target_pos", "target_index", "target_tokens", "target_cls"} & set(got)
        shown = got["input_ids"][:, 0] if layout == "padded" else got["input_ids"][0]
        assert torch.equal(shown, got["original_sequence"])  # no [MASK], no random token
        assert (want["input_ids"][:, 0] == 3).sum() == 0
        for j in range(len(got["lengths"])):
            n = int(got["lengths"][j])
            row = (got["input_ids"][j, :, :n] if layout == "padded" else
                   got["input_ids"][:, int(got["cu_seqlens"][j]) : int(got["cu_seqlens"][j + 1])])
            assert torch.equal(row, want["input_ids"][j, :, :n])
        if i == 2:
            break


def test_packed_layout_refuses_a_count_for_another_max_len(nomlm_dataset: Path) -> None:
    """count_tokens sized the packed layout for one crop; model_batch asked for another would gather a wrong number
    of rows (on CUDA, unchecked): refused in one line naming both, before any kernel."""
    from lifeseq_shards.reader import ShardedDataset

    host = next(iter(ShardedDataset(nomlm_dataset, split="train", batch_size=16, seed=1, packed=True)))
    for counted_for, asked in ((None, 32), (32, None), (32, 48)):
        batch = to_device(count_tokens(host, counted_for), "cpu")
        with pytest.raises(ValueError, match=f"counted for max_len={counted_for}.*max_len={asked}"):
            model_batch(batch, layout=PACKED, max_len=asked)
        model_batch(batch, layout=PACKED, max_len=counted_for)  # as counted: fine
    assert count_tokens(count_tokens(host, 32), 48).counted_for == 32  # a counted batch comes back as is
