"""The data path for a plain PyTorch training loop (no Lightning): :class:`LifeSeqData` hands this rank the model's
batches on the device, numbers the epochs and saves / restores its position inside the loop's own
``torch.save({...})``; :class:`DeviceMetrics` sums the losses on the device, so a loop logs them without a host sync
per step. docs/guides/train-plain-loop.md shows a whole loop.

``LifeSeqData`` is built from the same parts as ``LifeSeqDataModule`` (:class:`~lifeseq_shards.datapath.DataParts`):
the same loaders, masks, layouts and prefetch; only its world, epoch and device come from the process instead of a
Trainer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .datapath import DataParts
from .device.prefetch import OFF, STREAM, DevicePrefetcher
from .reader import ShardedLoader, World

if TYPE_CHECKING:  # a plain loop without a writer loads no Lightning
    from .embed.writer import EmbeddingWriterHooks


class LifeSeqData(DataParts):
    """This rank's model batches for a plain loop: ``train()``, ``val()`` and ``predict()`` are iterables of the
    model's batch on ``device`` (copied, unpacked, MLM-masked, padded or packed, the next built during the current
    step when ``prefetch``, by default on CUDA), each with the exact ``len()`` of this rank's batches.

    Takes ``LifeSeqDataModule``'s arguments (their meaning is the same), plus ``device`` (default: the current CUDA
    device, else the CPU) and ``world`` (a :class:`~lifeseq_shards.reader.World`; default: torch.distributed once
    initialised, else torchrun's or srun's variables). Build it after ``init_process_group``.

    Epochs: ``set_epoch(e)`` before each epoch's ``train()`` (without it each pass is the next epoch); every epoch is
    a new order and new masks. Resume: ``state_dict()`` after a training step counts that step's batch as done; it
    holds no rank, so the state rank 0 saves resumes every rank. ``load_state_dict(state)`` before iterating;
    :attr:`epoch` is then the epoch to go on with, and its ``train()`` returns exactly the batches the interrupted
    run had not trained on (the rest of a mid-epoch checkpoint's epoch, or the next epoch after an end-of-epoch one).
    The position is the train loader's (:attr:`ShardedLoader.position`); this class keeps no count of its own.
    With ``restart_epoch=True``, ``load_state_dict`` reads only the checkpoint's epoch, which starts over at its
    first batch (for a checkpoint whose position cannot be resumed exactly; its refusal says so).
    """

    def __init__(self, data_dir: str | os.PathLike[str], batch_size: int = 256, num_workers: int = 2, *,
                 device: torch.device | str | None = None, world: World | None = None, **kwargs: Any) -> None:
        super().__init__(data_dir, batch_size, num_workers, **kwargs)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        # refused here, naming the argument: else the first batch fails deep inside torch
        if self.device.type == "cuda" and not (torch.cuda.is_available() and (self.device.index or 0)
                                               < torch.cuda.device_count()):
            raise ValueError(f"LifeSeqData(device={str(device)!r}): this process sees "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s) "
                             f"(torch {torch.__version__}); pass device='cpu', or leave device unset (CUDA when "
                             "there is one, else the CPU)")
        self.world = World.current() if world is None else world
        self._val: DevicePrefetcher | None = None
        self._predict: DevicePrefetcher | None = None

    def _world(self) -> World:
        return self.world

    def _epoch(self) -> int:
        return self._train.position.epoch if self._train is not None else 0

    @property
    def epoch(self) -> int:
        """The epoch of the pass under way, or of the last one, until ``set_epoch`` or ``load_state_dict`` moves it
        (then the epoch to go on with)."""
        return self.train().position.epoch

    @property
    def resumed_batches(self) -> int:
        """How many batches of :attr:`epoch` were trained before the next (or current) ``train()`` pass: a loaded
        mid-epoch position's (in this arrangement's numbering), else 0. Number the steps from it (read after
        ``set_epoch`` or ``train()``)."""
        return self._train_loader_of().pass_start.batches

    def schedule_steps(self, epochs: int) -> tuple[int, int]:
        """(optimizer steps taken, optimizer steps in a run of ``epochs`` epochs) as this arrangement counts them, one
        step a batch: ``epochs x len(train())`` and the batches before :attr:`epoch`'s position. A run resumed in
        another arrangement (ranks, workers, batch size) has other steps left than the checkpoint's scheduler was sized
        for: :func:`lifeseq_shards.schedule.resize_one_cycle` fits a restored OneCycleLR to these (call it after
        ``load_state_dict``; it changes nothing in the checkpoint's own arrangement).

        Args:
            epochs: the epochs the whole run trains (the scheduler's ``epochs``).
        """
        per_epoch = len(self.train())
        return self.epoch * per_epoch + self.resumed_batches, epochs * per_epoch

    def set_epoch(self, epoch: int) -> None:
        """The next ``train()`` reads epoch ``epoch`` from its start (or from the loaded position, when that is in
        ``epoch``). Refused when a loaded position is in another epoch: the run would skip or replay batches."""
        self._train_loader_of().set_epoch(epoch)

    def train(self) -> DevicePrefetcher:
        """This epoch's training batches (call it once per epoch): ``len()`` is this rank's batch count of a whole
        epoch, and :attr:`resumed_batches` how many of them a resumed pass leaves out (number the steps from it)."""
        if self._train is None:
            loader = self._train_loader()
            device = self.device
            # each batch masked with its own pass's epoch, whatever the loop told set_epoch
            self._train = DevicePrefetcher(loader, lambda batch: self.builder(batch, device, loader.position.epoch),
                                           device, self._prefetch(device))
        return self._train  # type: ignore[return-value]

    def _train_loader_of(self) -> ShardedLoader:
        return self.train().loader  # type: ignore[return-value]

    def val(self) -> DevicePrefetcher:
        """The val split (every rank the same number of batches), masked as training's epoch is."""
        if self._val is None:
            self._val = self._built(self._val_loader(),
                                    lambda batch: self.val_builder(batch, self.device, self._epoch()))
        return self._val

    def predict(self, writer: EmbeddingWriterHooks | None = None, model: torch.nn.Module | None = None,
                ) -> DevicePrefetcher:
        """Every person once (``predict_split``: :attr:`predict_splits`), never masked or permuted; ranks may differ
        in batch counts.

        With an :class:`~lifeseq_shards.EmbeddingWriter` (docs/guides/embed.md): opened on every rank, then only the
        shards it has not written yet, each person with its ``shard``; ``writer.write(model.predict_step(batch, i),
        batch)`` for each batch, then ``writer.finish()``. ``model`` gives the writer its fields and, unless the
        writer was given ``model=``, the name of the output (its weights' fingerprint)."""
        if writer is not None:  # a new pass each call: the shards left are the writer's, at this call
            return self._built(self._left_to_embed(writer, model),
                               lambda batch: self.predict_builder(batch, self.device, 0))
        if self._predict is None:
            self._predict = self._built(self._predict_loader(),
                                        lambda batch: self.predict_builder(batch, self.device, 0))
        return self._predict

    def _built(self, loader: ShardedLoader, build: Any) -> DevicePrefetcher:
        # val and predict build ahead on a side stream or not at all: the background thread is training's
        return DevicePrefetcher(loader, build, self.device, STREAM if self._prefetch(self.device) != OFF else OFF)

    # -- the position, for the loop's own checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training goes on: after the last batch ``train()`` handed out (batches built ahead excluded)."""
        return {"train": self.train().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (a :meth:`state_dict`; ``LifeSeqDataModule``'s checkpoint entry has the same
        arrangement), or a whole checkpoint holding one (``ShardedLoader.load_state_dict`` finds it). Before the next
        ``train()`` pass begins; a changed dataset or setting is refused by name (``restart_epoch``: only its epoch
        is read, and starts over)."""
        self._load_position(self.train(), state)


class DeviceMetrics:
    """Running sums of the scalars ``names`` on ``device``: ``add`` queues a few device ops and never waits for the
    device; ``compute`` reads the means with one host sync (and, across ranks, one all-reduce), then starts over.

    """

    def __init__(self, names: Sequence[str], device: torch.device | str) -> None:
        self.names = tuple(names)
        self.device = torch.device(device)
        self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        self._steps = 0  # counted on the host: known without asking the device

    def add(self, **values: torch.Tensor | float) -> None:
        """One step's values (tensors are detached; a number is filled in on the device, never copied over)."""
        if set(values) != set(self.names):
            raise ValueError(f"DeviceMetrics.add needs {', '.join(self.names)}, got {', '.join(sorted(values))}")
        step = [values[n].detach().reshape(()).to(self.device, torch.float64) if isinstance(values[n], torch.Tensor)
                else torch.full((), float(values[n]), dtype=torch.float64, device=self.device) for n in self.names]
        self._sums += torch.stack(step)
        self._steps += 1

    def compute(self, all_ranks: bool = True) -> dict[str, float]:
        """The means since the last ``compute`` (NaN with no step), over every rank when ``all_ranks`` and
        torch.distributed is initialised (a collective: every rank must call it)."""
        count = torch.full((1,), float(self._steps), dtype=torch.float64, device=self.device)
        sums = torch.cat([self._sums, count])
        self._sums.zero_()
        self._steps = 0
        dist = torch.distributed
        if all_ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        *totals, steps = sums.tolist()
        return {n: (t / steps if steps else float("nan")) for n, t in zip(self.names, totals, strict=True)}
