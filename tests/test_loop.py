"""LifeSeqData (the plain loop's data path) in one process: the DataModule's batches, exact resume from its own
state (prefetched batches not counted), new orders and masks each epoch, loud refusals, and DeviceMetrics without a
host sync per step. The researcher-style loop under torchrun, killed and resumed, is in tests/test_plain_loop.py."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lifeseq_shards import DeviceMetrics, LifeSeqData, LifeSeqDataModule, ShardedDataset, ShardedLoader
from lifeseq_shards.device.build import host_sync_guard
from lifeseq_shards.device.prefetch import OFF, STREAM, THREAD, DevicePrefetcher
from lifeseq_shards.masking import MaskingConfig
from lifeseq_shards.plan.resume import Position
from lifeseq_shards.reader import World
from lifeseq_shards.schedule import resize_one_cycle

BATCH = 64


def data(root: Path, **kw: Any) -> LifeSeqData:
    kw = {"num_workers": 0, "masking": MaskingConfig(), "world": World(0, 1), **kw}
    return LifeSeqData(root, BATCH, **kw)


def ids(batches: Any) -> list[list[int]]:
    return [b["person_id"].tolist() for b in batches]


def datamodule_batches(dm: LifeSeqDataModule, loader: Any, epoch: int, predicting: bool = False) -> list[dict]:
    """The batches as Lightning's hooks make them (transfer, then on_after_batch_transfer)."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=0))
    dm.trainer = SimpleNamespace(global_rank=0, world_size=1, training=False, predicting=predicting,
                                 current_epoch=epoch, strategy=SimpleNamespace(root_device=torch.device("cpu")),
                                 fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    return [dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, torch.device("cpu"), 0), 0) for b in loader]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key, value in x.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, y[key]), key
            else:
                assert value == y[key], key


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batches_are_the_datamodules(vocab_dataset: Path, layout: str) -> None:
    kw = {"num_workers": 0, "masking": MaskingConfig(), "layout": layout, "pad_to": 256 if layout == "packed" else None}
    dm = LifeSeqDataModule(vocab_dataset, BATCH, **kw)
    dm.trainer = None
    loop = data(vocab_dataset, **kw)
    for epoch in (0, 1):
        loop.set_epoch(epoch)
        train = loop.train()
        assert len(train) == len(dm.train_dataloader())
        dm.trainer = None
        host = dm.train_dataloader()
        host.set_epoch(epoch)
        assert_same_batches(list(train), datamodule_batches(dm, host, epoch))
        assert_same_batches(list(loop.val()), datamodule_batches(dm, dm.val_dataloader(), epoch))
    assert_same_batches(list(loop.predict()), datamodule_batches(dm, dm.predict_dataloader(), 0, predicting=True))
    assert "target_tokens" not in next(iter(loop.predict()))


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_mid_epoch_gives_exactly_the_rest(vocab_dataset: Path, prefetch: bool) -> None:
    full = data(vocab_dataset, prefetch=prefetch)
    epoch0 = list(full.train())
    epoch1 = list(full.train())  # no set_epoch: the next pass is the next epoch
    assert ids(epoch0) != ids(epoch1) and set(map(tuple, ids(epoch0))) != set(map(tuple, ids(epoch1)))
    run = data(vocab_dataset, prefetch=prefetch)
    for i, _batch in enumerate(run.train(), start=1):
        if i == 5:  # the step on batch 5 is done: the prefetcher has batch 6 built already
            state = run.state_dict()
            break
    resumed = data(vocab_dataset, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert resumed.epoch == 0
    resumed.set_epoch(resumed.epoch)  # the loop's set_epoch at the top of the resumed epoch keeps the position
    assert resumed.resumed_batches == 5
    train = resumed.train()
    assert resumed.resumed_batches == 5 and len(train) == len(epoch0)
    rest = list(train)
    assert_same_batches(rest, epoch0[5:])  # same persons, same masks
    resumed.set_epoch(1)
    assert resumed.resumed_batches == 0
    assert_same_batches(list(resumed.train()), epoch1)


@pytest.mark.slow
def test_end_of_epoch_state_goes_on_with_the_next_epoch(vocab_dataset: Path) -> None:
    run = data(vocab_dataset)
    list(run.train())
    state = run.state_dict()
    resumed = data(vocab_dataset)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert ids(resumed.train()) == ids(_epoch(vocab_dataset, 1))


def test_a_whole_checkpoint_resumes_as_its_data_state(vocab_dataset: Path) -> None:
    """The plain loop's checkpoint as docs/guides/train-plain-loop.md saves it, handed over whole (before: KeyError:
    'train'); a damaged state in it is refused naming the key."""
    run = data(vocab_dataset)
    batches = iter(run.train())
    for _ in range(3):
        next(batches)
    state = run.state_dict()
    del batches
    checkpoint = {"model": {"w": torch.zeros(2)}, "optimizer": {}, "data": state}
    resumed = data(vocab_dataset)
    resumed.load_state_dict(checkpoint)
    assert (resumed.epoch, resumed.resumed_batches) == (0, 3)
    state["train"]["layout"]["world_size"] = 0
    with pytest.raises(ValueError, match=r"the checkpoint's loader state \['data'\]\['train'\] has "
                                         r"layout\['world_size'\] 0, not an integer >= 1"):
        data(vocab_dataset).load_state_dict(checkpoint)


def _epoch(root: Path, epoch: int) -> list[dict]:
    run = data(root)
    run.set_epoch(epoch)
    return list(run.train())


@pytest.mark.slow
def test_the_state_resumes_the_datamodule_too(vocab_dataset: Path) -> None:
    run = data(vocab_dataset, masking=None)
    for i, _batch in enumerate(run.train(), start=1):
        if i == 3:
            state = run.state_dict()
            break
    dm = LifeSeqDataModule(vocab_dataset, BATCH, num_workers=0)
    dm.trainer = None
    dm.load_state_dict(state)
    assert ids(dm.builder(b, "cpu", 0) for b in dm.train_dataloader()) == ids(_epoch(vocab_dataset, 0))[3:]


@pytest.mark.slow
def test_a_schedule_saved_on_two_ranks_refitted_on_one_ends_with_the_run(vocab_dataset: Path) -> None:
    """A OneCycleLR sized on 2 ranks (epochs x that rank's batches), saved mid-epoch and resumed on 1 rank, where the
    epoch has about twice the batches: refitted to ``schedule_steps(epochs)`` it steps once per batch the resumed
    run trains and ends exactly at its last step; restored as saved, it is refused (``Tried to step``)."""
    epochs = 2

    def sized(run: LifeSeqData) -> torch.optim.lr_scheduler.OneCycleLR:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, epochs=epochs, steps_per_epoch=len(run.train()))

    two = data(vocab_dataset, world=World(0, 2))
    scheduler = sized(two)
    for i, _batch in enumerate(two.train(), start=1):
        scheduler.optimizer.step()
        scheduler.step()
        if i == 3:
            saved = {"data": two.state_dict(), "scheduler": scheduler.state_dict()}
            break
    for refit in (True, False):
        one = data(vocab_dataset)
        resumed = sized(one)
        resumed.load_state_dict(saved["scheduler"])
        one.load_state_dict(saved["data"])
        if refit:
            done, total = one.schedule_steps(epochs)
            assert total == epochs * len(one.train()) and 0 < done < len(one.train())
            resize_one_cycle(resumed, done, total)
        steps = 0
        with contextlib.nullcontext() if refit else pytest.raises(ValueError, match="Tried to step"):
            for epoch in range(one.epoch, epochs):
                one.set_epoch(epoch)
                for _batch in one.train():
                    resumed.optimizer.step()
                    resumed.step()
                    steps += 1
        if refit:
            assert resumed.last_epoch == resumed.total_steps == done + steps
            assert resumed.get_last_lr()[0] < 1e-4  # annealed to the cycle's end


def test_set_epoch_off_the_loaded_epoch_is_refused(vocab_dataset: Path) -> None:
    run = data(vocab_dataset)
    for i, _batch in enumerate(run.train(), start=1):
        if i == 2:
            state = run.state_dict()
            break
    resumed = data(vocab_dataset)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"goes on in epoch 0 after 2 batches, but set_epoch\(1\).*data.epoch"):
        resumed.set_epoch(1)


def test_a_state_is_refused_once_the_pass_began(vocab_dataset: Path) -> None:
    run = data(vocab_dataset)
    state = run.state_dict()
    it = iter(run.train())
    next(it)
    with pytest.raises(RuntimeError, match="after this loader began a pass"):
        run.load_state_dict(state)


def test_each_rank_of_the_world_reads_its_own_share(vocab_dataset: Path) -> None:
    """world=World(rank, size) reaches the train loader: each rank gets the reader's batches of that rank, and the
    ranks share no person."""
    shares = []
    for rank in range(2):
        world = World(rank, 2)
        reader = ShardedLoader(ShardedDataset(vocab_dataset, split="train", batch_size=BATCH, world=world))
        got = ids(data(vocab_dataset, world=world, masking=None).train())
        assert got == [b["person_id"].tolist() for b in reader] and got
        shares.append({p for batch in got for p in batch})
    assert not shares[0] & shares[1]


def test_prefetcher_off_builds_in_turn() -> None:
    built: list[int] = []
    loader = [{"x": i} for i in range(3)]
    prefetcher = DevicePrefetcher(loader, lambda b: built.append(b["x"]) or b, "cpu", OFF)
    for i, batch in enumerate(prefetcher):
        assert built == list(range(i + 1)) and batch["x"] == i  # nothing built before it is handed out
    with pytest.raises(ValueError, match="prefetch must be one of 'off', 'stream', 'thread', not 'ahead'"):
        DevicePrefetcher(loader, dict, "cpu", "ahead")
    with pytest.raises(ValueError, match="prefetch must be None, True, False or one of"):
        LifeSeqData("no-such-dir", prefetch="ahead")  # refused before the manifest is read


def test_device_metrics_add_without_a_sync_and_read_once() -> None:
    metrics = DeviceMetrics(("loss", "mlm"), "cpu")
    with host_sync_guard():
        for value in (1.0, 2.0, 6.0):
            metrics.add(loss=torch.tensor(value, requires_grad=True) * 1, mlm=value / 2)
    assert metrics.compute() == {"loss": 3.0, "mlm": 1.5}
    assert all(v != v for v in metrics.compute().values())  # started over: no step, NaN
    with pytest.raises(ValueError, match="needs loss, mlm, got loss"):
        metrics.add(loss=torch.tensor(1.0))


@pytest.mark.cuda
def test_on_cuda_the_batches_are_the_cpus_and_adding_a_metric_never_syncs(vocab_dataset: Path) -> None:
    """Prefetched on a side stream (CUDA's default), pinned, masked on the GPU: the CPU's batches, and
    DeviceMetrics.add under CUDA's sync debug mode "error"."""
    on_cpu = list(data(vocab_dataset, device="cpu").train())
    gpu = data(vocab_dataset, device="cuda")
    metrics = DeviceMetrics(("tokens",), gpu.device)
    on_gpu = []
    for batch in gpu.train():
        assert batch["input_ids"].is_cuda
        with host_sync_guard():
            metrics.add(tokens=batch["padding_mask"].sum())
        on_gpu.append({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    assert_same_batches(on_gpu, on_cpu)
    assert metrics.compute()["tokens"] == sum(int(b["padding_mask"].sum()) for b in on_cpu) / len(on_cpu)


@pytest.mark.parametrize("threaded", [False, True])
def test_the_loader_itself_stands_at_the_batch_handed_out(vocab_dataset: Path, threaded: bool) -> None:
    """One position, the loader's: a prefetcher that built batches ahead leaves it at the batch it handed out, and
    set_epoch moves it to the epoch's start."""
    run = data(vocab_dataset, prefetch=True)
    train = run.train()
    assert isinstance(train, DevicePrefetcher)
    train.prefetch = THREAD if threaded else STREAM
    loader = train.loader
    for i, _batch in enumerate(train, start=1):
        assert loader.position == Position(0, i)  # not i + 1 (built ahead), nor i + 2 (the thread's)
        if i == 3:
            break
    run.set_epoch(4)
    assert loader.position == Position(4, 0) and run.state_dict()["train"]["epoch"] == 4


def test_the_manifest_is_read_once_per_front_end(vocab_dataset: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end reads the manifest once and hands it to every loader it builds; the embedding writer takes it
    too, for its own checks and the predict dataset it builds."""
    from lifeseq_shards import EmbeddingWriter, datapath
    from lifeseq_shards.embed import writer as embed_writer
    from lifeseq_shards.reader import dataset as reader_dataset

    reads: list[str] = []
    read = datapath.read_manifest

    def counted(root: str) -> Any:
        reads.append(root)
        return read(root)

    for module in (datapath, reader_dataset, embed_writer):
        monkeypatch.setattr(module, "read_manifest", counted)
    run = data(vocab_dataset, masking=None)
    for loader in (run.train(), run.val(), run.predict()):
        assert len(loader) > 0
    assert reads == [str(vocab_dataset)]
    writer = EmbeddingWriter(tmp_path / "embeddings", fields={"cls": 4}, model="m")
    ds = writer.dataset(vocab_dataset, batch_size=BATCH, world=World(0, 1), manifest=run.manifest)
    assert ds.manifest is run.manifest and reads == [str(vocab_dataset)]
    assert ds.split == ("train", "val") == run.predict_splits  # the one default of the predict splits


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)], ids=str)
def test_a_cuda_device_without_cuda_is_refused_naming_the_argument(vocab_dataset: Path, device: Any) -> None:
    """It failed inside torch at the first batch, naming neither the argument nor what to pass."""
    with pytest.raises(ValueError, match=r"LifeSeqData\(device='cuda(:[01])?'\): this process sees no CUDA device.*"
                                         r"pass device='cpu'"):
        LifeSeqData(vocab_dataset, BATCH, num_workers=0, device=device)


@pytest.mark.slow
def test_a_token_budget_in_the_plain_loop(vocab_dataset: Path) -> None:
    """LifeSeqData(tokens_per_batch=...): the training batches hold at most the budget's real tokens, every train
    person once an epoch in len() batches, the same batches as the DataModule's; a mid-epoch state resumes exactly;
    validation stays batches of BATCH persons."""
    kw = {"layout": "packed", "tokens_per_batch": 6000}
    loop = data(vocab_dataset, **kw)
    train = loop.train()
    epoch0 = list(train)
    assert len(epoch0) == len(train)
    persons = [p for b in ids(epoch0) for p in b]
    assert len(persons) == len(set(persons)) == loop.manifest.splits["train"].persons
    assert max(int(b["lengths"].sum()) for b in epoch0) <= 6000
    dm = LifeSeqDataModule(vocab_dataset, BATCH, num_workers=0, masking=MaskingConfig(), **kw)
    dm.trainer = None
    host = dm.train_dataloader()
    host.set_epoch(0)
    assert_same_batches(epoch0, datamodule_batches(dm, host, 0))
    assert {len(b["person_id"]) for b in list(loop.val())[:-1]} == {BATCH}
    run = data(vocab_dataset, **kw)
    for i, _batch in enumerate(run.train(), start=1):
        if i == 3:
            state = run.state_dict()
            break
    assert state["train"]["layout"]["tokens_per_batch"] == 6000
    resumed = data(vocab_dataset, **kw)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed.train()), epoch0[3:])


@pytest.mark.slow
def test_static_shapes_give_every_training_batch_one_shape(vocab_dataset: Path) -> None:
    kw = {"layout": "packed", "pad_to": 512, "tokens_per_batch": 6000, "static_shapes": True}
    loop = data(vocab_dataset, **kw)
    shapes = {tuple((k, tuple(v.shape)) for k, v in sorted(b.items()) if isinstance(v, torch.Tensor))
              for b in loop.train()}
    assert len(shapes) == 1  # the whole epoch: one shape, so a compiled step compiles once
    varying = data(vocab_dataset, **{**kw, "static_shapes": False})
    assert len({tuple(b["input_ids"].shape) for b in varying.train()}) > 1
    # validation keeps batches of persons, and their shapes
    assert {len(b["person_id"]) for b in list(loop.val())[:-1]} == {BATCH}
    with pytest.raises(ValueError, match="static_shapes=True pads each training batch to the token budget"):
        data(vocab_dataset, layout="packed", pad_to=512, static_shapes=True)


@pytest.mark.slow
def test_a_position_that_cannot_resume_exactly_starts_its_epoch_over_when_asked(vocab_dataset: Path) -> None:
    """Issue 40: a mid-epoch state of another balance is refused in one line that names the way to start the epoch
    over in this front end's terms (it said "without the loader's state"); restart_epoch=True does: the state's
    epoch, from its first batch, every train person once (the 3 batches trained before included)."""
    run = data(vocab_dataset, layout="packed", tokens_per_batch=6000)
    for i, _batch in enumerate(run.train(), start=1):
        if i == 3:
            state = run.state_dict()
            break
    with pytest.raises(ValueError) as refusal:
        data(vocab_dataset, layout="packed", tokens_per_batch=6000, balance="attention").load_state_dict(state)
    said = str(refusal.value)
    assert "cannot resume exactly inside epoch 0" in said and "restart_epoch=True on" in said and "\n" not in said
    again = data(vocab_dataset, layout="packed", tokens_per_batch=6000, balance="attention",
                 restart_epoch=True)
    with pytest.warns(UserWarning, match="epoch 0 starts over .*the 3 batches of it trained before"):
        again.load_state_dict(state)
    assert again.epoch == 0 and again.resumed_batches == 0
    whole = list(again.train())
    fresh = data(vocab_dataset, layout="packed", tokens_per_batch=6000, balance="attention")
    assert ids(whole) == ids(fresh.train())  # epoch 0 of this budget, as a fresh run reads it
    persons = [p for b in ids(whole) for p in b]
    assert len(persons) == len(set(persons)) == again.manifest.splits["train"].persons
