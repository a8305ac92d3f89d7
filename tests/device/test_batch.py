"""The typed batches: a schema field the device does not build from reaches the model batch or is refused by name,
and the model batch behaves as Lightning and torch expect of a batch (a mapping they can rebuild) on both stacks."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.reader import BatchSpec, collate
from lifeseq_shards.store.format import RAGGED, SCALAR, Block, Field, make_schema, to_runs

LENGTHS = np.array([3, 5, 2], dtype=np.uint16)


def _block(extra: Field, values: np.ndarray) -> tuple[Block, list[Field]]:
    """Three persons in the format-2 layout (stamps once per run) with ``extra`` added to the schema."""
    schema = [*make_schema("uint16"), extra]
    n = int(LENGTHS.sum())
    tokens = np.arange(5, 5 + n).astype(np.uint16)
    columns = {"person_id": np.array([7, 8, 9], dtype=np.int64), "length": LENGTHS, "tokens": tokens,
               "abspos": (np.arange(n) // 2).astype(np.int16), "age": np.full(n, 30, dtype=np.uint8),
               "segment": np.ones(n, dtype=np.uint8), extra.name: values}
    return to_runs(Block(columns), schema), schema


def _model_batches(block: Block, schema: list[Field]) -> dict[str, object]:
    """The model batch of every host layout (packed buffer, padded) and model layout."""
    out = {}
    for packed in (True, False):
        host = collate(block, BatchSpec(schema, packed=packed))
        for layout in ("padded", "packed") if packed else ("padded",):
            out[f"{'packed' if packed else 'padded'} host, {layout} model"] = BatchBuilder(layout=layout)(
                host, "cpu", 0)
    return out


@pytest.mark.parametrize(("dtype", "want"), [("int32", torch.int32), ("uint16", torch.int32), ("uint8", torch.uint8)])
def test_an_extra_per_person_field_reaches_the_model_batch(dtype: str, want: torch.dtype) -> None:
    """A field the device side does not build from is carried per person as it is, an unsigned one wider than 8
    bits widened (the same dtype on every torch); before, it was dropped on the way to the model."""
    values = np.array([np.iinfo(dtype).max, 0, 1], dtype=dtype)
    block, schema = _block(Field("income", dtype, SCALAR), values)
    for name, batch in _model_batches(block, schema).items():
        assert "income" in batch, name
        assert batch["income"].dtype == want and batch["income"].tolist() == values.tolist(), name
        assert batch["person_id"].tolist() == [7, 8, 9], name


def test_a_padded_host_batch_reads_its_fields_by_name_unsigned() -> None:
    """``host["tokens"]`` as the dict batches were read: a uint16 token id at 65535 reads 65535 on every torch
    (before torch 2.3 it crosses as an int16 view, which must not leak out as -1)."""
    block, schema = _block(Field("income", "int32", SCALAR), np.zeros(3, dtype=np.int32))
    block.columns["tokens"][0] = 65535
    host = collate(block, BatchSpec(schema))
    assert host["tokens"][0, 0].item() == 65535 and host["person_id"].tolist() == [7, 8, 9]
    assert "lengths" in host and "no such field" not in host and set(host.keys()) == set(host.tensors)
    with pytest.raises(KeyError):
        host["no such field"]


def test_an_extra_per_token_field_is_refused_by_name() -> None:
    """A per-token field the model batch has no place for is refused in one line naming it, never dropped."""
    block, schema = _block(Field("visits", "uint8", RAGGED), np.arange(int(LENGTHS.sum()), dtype=np.uint8))
    for packed in (True, False):
        host = collate(block, BatchSpec(schema, packed=packed))
        with pytest.raises(ValueError, match=r"field 'visits' has a value per token") as e:
            BatchBuilder()(host, "cpu", 0)
        assert "\n" not in str(e.value)


def test_a_schema_with_an_unknown_per_token_field_is_refused_before_any_batch() -> None:
    """What the DataModule and the plain loop check when they open a dataset: the same refusal, naming the
    dataset; per-person extras are what the model batch will carry."""
    from lifeseq_shards.device.batch import check_schema
    from lifeseq_shards.reader.stages import SHARD_FIELD

    assert check_schema([*make_schema("uint16", offline_mlm=True), SHARD_FIELD, Field("income", "int32", SCALAR)],
                        "data/x") == ["shard", "income"]
    with pytest.raises(ValueError, match=r"^data/x: the dataset's field 'visits' has a value per token"):
        check_schema([*make_schema("uint16"), Field("visits", "uint8", RAGGED)], "data/x")


@pytest.fixture(scope="module")
def model_batches(nomlm_dataset: Path) -> dict[str, object]:
    from lifeseq_shards import ShardedDataset
    from lifeseq_shards.masking import DynamicMasker, MaskingConfig

    host = next(iter(ShardedDataset(nomlm_dataset, split="train", batch_size=16, seed=1, packed=True)))
    masker = DynamicMasker(MaskingConfig(vocab_size=2970))
    return {layout: BatchBuilder(masker, layout, 64)(host, "cpu", 0) for layout in ("padded", "packed")}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_model_batch_reads_as_a_read_only_mapping(model_batches: dict, layout: str) -> None:
    from lifeseq_shards.device.batch import ModelBatch, PackedModelBatch, PaddedModelBatch

    batch = model_batches[layout]
    assert type(batch) is (PaddedModelBatch if layout == "padded" else PackedModelBatch)
    names = ["person_id", "lengths", "target_tokens", "target_cls", "input_ids", "original_sequence"]
    names += ["padding_mask", "target_pos"] if layout == "padded" else ["cu_seqlens", "max_len", "target_index"]
    assert set(batch.keys()) == set(names) and all(n in batch for n in names) and len(batch) == len(names)
    assert batch.input_ids is batch["input_ids"] and dict(batch)["person_id"] is batch["person_id"]
    with pytest.raises(TypeError):
        batch["input_ids"] = batch["input_ids"]  # type: ignore[index]
    with pytest.raises(AttributeError, match="read-only"):
        batch.input_ids = batch["input_ids"]
    with pytest.raises(AttributeError, match="no field 'nope'"):
        batch.nope  # noqa: B018
    changed = batch.replace(target_tokens=torch.zeros_like(batch["target_tokens"]))
    assert type(changed) is type(batch) and not changed["target_tokens"].any() and batch["target_tokens"].any()
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is type(batch) and again.keys() == batch.keys()
    assert all(torch.equal(again[k], v) if isinstance(v, torch.Tensor) else again[k] == v for k, v in batch.items())
    assert isinstance(batch, ModelBatch)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_lightning_rebuilds_and_sizes_the_model_batch(model_batches: dict, layout: str) -> None:
    """What Lightning does with a batch: convert its tensors (a precision plugin's ``convert_input``, through
    lightning_utilities' apply_to_collection, which refuses frozen dataclasses) and infer its batch size for
    ``self.log``: the model batch stays its own type, sized by its persons, in either Lightning package."""
    import lightning.pytorch.utilities.data as lightning_data
    import pytorch_lightning.utilities.data as pl_data
    from lightning.pytorch.plugins.precision import DoublePrecision
    from lightning_utilities.core.apply_func import apply_to_collection

    batch = model_batches[layout]
    doubled = apply_to_collection(batch, torch.Tensor, lambda t: t.double() if t.is_floating_point() else t + 0)
    assert type(doubled) is type(batch) and doubled.keys() == batch.keys()
    assert all(torch.equal(doubled[k], v) if isinstance(v, torch.Tensor) else doubled[k] == v
               for k, v in batch.items())
    assert type(DoublePrecision().convert_input(batch)) is type(batch)
    for data in (lightning_data, pl_data):
        assert data.extract_batch_size(batch) == 16


def test_torch_pin_memory_keeps_the_host_batch_types(nomlm_dataset: Path) -> None:
    """torch's pin-memory step (the DataLoader's pin_memory thread; torch 2.1 tries a mapping first, newer torch a
    ``pin_memory`` method) hands the host batches back as they are: a packed buffer still in numpy is left for
    ShardedLoader to pin as it copies it out, not turned into a dict or list."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from lifeseq_shards import ShardedDataset
    from lifeseq_shards.device.batch import PackedBatch

    hosts = list(ShardedDataset(nomlm_dataset, split="train", batch_size=16, seed=1, packed=True))[:2]
    pinned = pin_memory(hosts)
    assert [type(b) for b in pinned] == [PackedBatch, PackedBatch] and all(a is b for a, b in zip(pinned, hosts,
                                                                                                   strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [True, False])
def test_torch_pin_memory_pins_the_host_batches(nomlm_dataset: Path, packed: bool) -> None:
    from torch.utils.data._utils.pin_memory import pin_memory

    from lifeseq_shards import ShardedDataset
    from lifeseq_shards.device.batch import PackedBatch

    host = next(iter(ShardedDataset(nomlm_dataset, split="train", batch_size=16, seed=1, packed=packed)))
    if packed:
        host = host.with_buffer(torch.from_numpy(host.buffer))
    (pinned,) = pin_memory([host])
    assert type(pinned) is type(host)
    tensors = [pinned.buffer] if isinstance(pinned, PackedBatch) else list(pinned.tensors.values())
    assert tensors and all(t.is_pinned() for t in tensors)
