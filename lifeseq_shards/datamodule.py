"""A LightningDataModule over a converted dataset: rank and world size from the Trainer, exact per-rank lengths,
packed narrow batches over the bus (only real tokens), the seed's batch (and dynamic MLM masks) built on the
device, and a resume that is exact whenever Lightning builds the train loader.

Lightning ships as two packages whose classes are distinct: a ``pytorch_lightning`` Trainer refuses a
``lightning`` DataModule ("Expected a parent"). :class:`LifeSeqDataHooks` holds all the behaviour; each package
gets a class that only adds its base: :class:`LifeSeqDataModule` here for ``import lightning``, and
``lifeseq_shards.pl.LifeSeqDataModule`` for ``import pytorch_lightning``. Both have the same qualified name, the key
Lightning files their data position under in a checkpoint.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning as L
import torch

from . import lightning_loop
from .datapath import DataParts
from .device.build import BatchBuilder
from .device.prefetch import OFF, DevicePrefetcher
from .embed.writer import EmbeddingWriterHooks
from .reader import ShardedLoader, World


def _quiet_predict_warnings() -> None:
    """Two warnings of Lightning's predict loop that read like a failure where all is well, filtered by their text,
    which names this package's loader (so no other loader's warning is hidden): "Total length of `ShardedLoader`
    across ranks is zero" (a rank with no shard to read, or a resumed job with nothing left: complete mode deals
    whole shards, and rank 0 says how many are left) and "Couldn't infer the batch indices fetched from your
    dataloader: `ShardedLoader`" (an iterable loader has no sampler of indices; the EmbeddingWriter keys each
    person by its id and shard, not by index). Adding a filter again replaces it: no duplicates."""
    for message in (r"Total length of `ShardedLoader` across ranks is zero",
                    r"Couldn't infer the batch indices fetched from your dataloader: `ShardedLoader`"):
        warnings.filterwarnings("ignore", message=message)


class LifeSeqDataHooks(DataParts):
    """What ``LifeSeqDataModule`` does, for either Lightning package (docs/reference/ddp.md has the seed's diff).

    Arguments (built into one frozen :class:`~lifeseq_shards.datapath.DataConfig` at construction, the manifest read
    once): ``data_dir``, ``batch_size``, ``num_workers``, ``seed`` (the shuffle's), ``pin_memory`` and
    ``persistent_workers`` (the loaders'), ``batches_per_message`` (a worker's message; ``ShardedLoader``'s).
    ``masking``: None (no MLM targets), :data:`~lifeseq_shards.masking.OFFLINE` or its word ``"offline"`` (the masks
    converted from the seed's encoded_mlm.h5, bit for bit), or a :class:`MaskingConfig` (fresh masks every epoch,
    drawn on the device from (seed, epoch, person id); its ``vocab_size`` comes from the dataset's manifest; on an
    offline-MLM dataset, whose sequences are stored after the seed's CLS task, only with ``cls_task=False``); a
    :class:`~lifeseq_shards.masking.DynamicMasker` stands for its configuration, launched its way (``"compiled"`` or
    ``"graphed"`` draw the same masks with fewer kernel launches). Validation reads every val person once,
    unshuffled, in the same number of batches on every rank (``mode="exact"``: a val step that logs with
    ``sync_dist=True`` would otherwise hang), or refuses the arrangement saying what to change. ``drop_last`` drops each
    slot's short last batch in training only: validation loses no one. Predict reads every person once (train and
    val with their remainders, unless ``predict_split`` names others), never masked and never permuted; with an
    :class:`~lifeseq_shards.EmbeddingWriter` among the Trainer's callbacks, only the shards it has not written yet,
    each person with its ``shard``.

    ``static_shapes=True`` (with ``tokens_per_batch``, ``layout="packed"`` and ``pad_to``) pads every training batch
    on the device to the budget's token positions and to the most persons a batch of the split can hold
    (``device.shape.StaticShape``), so that a compiled step compiles once and a CUDA graph can be captured; the
    losses are those of the unpadded batch. Validation and predict batches keep their own shapes.

    ``tokens_per_batch``: training batches by a token budget instead of ``batch_size`` persons: each rank's batch
    holds as many persons as fit in that many real tokens, the ranks of every step balanced (``balance``:
    ``"tokens"``, or ``"attention"`` for the sum of len^2), planned from every person's length before training
    (``ShardedDataset`` says what holds: nobody left out, the same steps on every rank, exact ``len()`` and resume, in
    another arrangement or budget too). ``batch_size`` then sizes only the validation and predict batches, which stay
    batches of persons. docs/guides/tune-gpu.md says when to use which.

    ``layout`` is the model batch's: ``"padded"`` (the seed's) or ``"packed"``, which hands the model only the real
    tokens (``device.model_batch``; ``pad_to`` then crops without padding) for the encoder's padding-free path.
    ``pad_to``: the padded width (``device.shape.Padding`` says which side pads and crops). ``prefetch``: how the
    training batches are built (``device.prefetch.DevicePrefetcher``): ``"off"`` (by Lightning's hooks),
    ``"stream"`` (the next on a side CUDA stream during the current step) or ``"thread"`` (and launched from a
    background thread: opt-in until a GPU run says it pays, docs/results/training-gpu.md); None, the default, is
    ``"stream"`` when training on CUDA, else ``"off"``; ``True`` and ``False`` say ``"stream"`` and ``"off"``.

    Resume: the train loader's position is saved in the DataModule's own checkpoint entry and handed to the train
    loader whenever it is built, before or after Lightning restores the checkpoint (``estimated_stepping_batches``
    builds it before); every training batch is checked against Lightning's epoch and batch count, so a loader that
    is not where the trainer thinks raises instead of replaying or skipping batches. ``restart_epoch=True``: a
    checkpoint's loader position is not resumed, its epoch starts over at its first batch (the trainer's count moved
    there too): for a checkpoint whose position cannot be resumed exactly (saved mid-epoch with another
    ``tokens_per_batch``, ``balance`` or ``pad_to``, by an older version, or edited), whose refusal says so.
    """

    trainer: Any  # Lightning's Trainer once attached (either package's)

    def _world(self) -> World:
        trainer = self.trainer
        if trainer is None:  # a loop of its own: the launcher's variables, as a ShardedDataset takes them
            return World.current()
        return World(trainer.global_rank, trainer.world_size)

    def train_dataloader(self) -> ShardedLoader | DevicePrefetcher:
        loader = self._train_loader()
        device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
        prefetch = self._prefetch(device)
        if prefetch == OFF:  # the hooks build each batch (transfer_batch_to_device, on_after_batch_transfer)
            self._train = loader
        else:
            self._train = DevicePrefetcher(loader, lambda batch: self.builder(batch, device, self._epoch()), device,
                                           prefetch)
        return self._train

    def val_dataloader(self) -> ShardedLoader:
        return self._val_loader()

    def predict_dataloader(self) -> ShardedLoader:
        _quiet_predict_warnings()
        writers = [c for c in getattr(self.trainer, "callbacks", []) if isinstance(c, EmbeddingWriterHooks)]
        if not writers:
            return self._predict_loader()
        # an EmbeddingWriter: only the shards it has not written, each person with its shard
        return self._left_to_embed(writers[0], self.trainer.lightning_module)

    def _epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    # -- resume: Lightning saves state_dict() in every checkpoint and hands it back before the fit goes on --------
    def state_dict(self) -> dict[str, Any]:
        if self._train is None:
            return {}
        n = self.trainer.num_training_batches if self.trainer is not None else math.inf
        # limit_train_batches ends an epoch early: a checkpoint at its end resumes at the next epoch's start
        return {"train": self._train.state_dict(epoch_batches=int(n) if math.isfinite(n) else None,
                                                unfinished=self._unfinished())}

    def _unfinished(self) -> int:
        """The batches the train loader handed out that Lightning trains again on resume
        (:func:`lightning_loop.batches_unfinished`)."""
        assert self._train is not None
        at = self._train.position
        trainer = self.trainer
        if trainer is None or self._trainer_fn() != "fit" or trainer.current_epoch != at.epoch:
            return 0
        return lightning_loop.batches_unfinished(trainer, at.batches)

    def _trainer_fn(self) -> str | None:
        """The Trainer's entry point under way ("fit", "validate", "test", "predict"; a str enum), None unknown."""
        return getattr(getattr(self.trainer, "state", None), "fn", None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # validate/test/predict(ckpt_path=...) restore it too: kept, it would move a later fit off its epoch's start
        if "train" not in state or self._trainer_fn() not in (None, "fit"):
            return
        if self._trainer_fn() == "fit":  # Lightning 2.2 would train a batch saved at its end again
            lightning_loop.finish_saved_batch_on_restart(self.trainer)
            lightning_loop.after_restart_reset(self.trainer, self._renumber_trainer)
        if self._train is None:
            self._resume = state["train"]
        else:  # strategies that restore after setup: the loader exists, its pass has not begun (it refuses else)
            self._load_position(self._train, state["train"])

    def schedule_steps(self) -> tuple[int, int]:
        """(optimizer steps taken, optimizer steps in the fit) as this arrangement counts them: Lightning's
        ``estimated_stepping_batches``, and the steps before the train loader's position. A fit resumed in another
        arrangement (ranks, workers, batch size) has other steps left than the checkpoint's schedule was sized for:
        :func:`lifeseq_shards.schedule.resize_one_cycle` fits it to these (docs/reference/ddp.md)."""
        trainer = self.trainer
        assert self._train is not None and trainer is not None, "schedule_steps() belongs in a fit (on_train_start)"
        at = self._train.position
        per_epoch = -(-int(trainer.num_training_batches) // trainer.accumulate_grad_batches)
        steps = at.epoch * per_epoch + at.batches // trainer.accumulate_grad_batches
        return steps, int(trainer.estimated_stepping_batches)

    # -- the batch on the device -------------------------------------------------------------------------------
    def _stage_builder(self) -> BatchBuilder:
        """Predict's builder (the sequences as they are) while predicting, validation's while validating (training's
        masks, without its static shape), else training's."""
        trainer = self.trainer
        if trainer is not None and trainer.predicting:
            return self.predict_builder
        return self.builder if trainer is None or trainer.training else self.val_builder

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return self._stage_builder().transfer(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:
            self._check_position(self.trainer)
        return self._stage_builder().widen(batch, self._epoch())

    def _renumber_trainer(self) -> None:
        """Resumed in another arrangement, the rest of the epoch runs from batch ``now`` to this arrangement's
        num_training_batches: the trainer's count moves there once Lightning has restored it (after the DataModule's
        state) and before it numbers the epoch's first batch."""
        if self._renumber is not None:
            lightning_loop.renumber(self.trainer, *self._renumber)
            self._renumber = None

    def _check_position(self, trainer: Any) -> None:
        """The train loader must stand where Lightning counts: a mismatch means batches replayed or skipped."""
        if self._train is None:
            return
        ready = lightning_loop.batches_ready(trainer)  # batches before this one
        at = self._train.position
        if (at.epoch, at.batches) != (trainer.current_epoch, ready + 1):
            raise RuntimeError(
                f"{self.data_dir}: the train loader is at batch {at.batches} of epoch {at.epoch} but the trainer at "
                f"batch {ready + 1} of epoch {trainer.current_epoch}: the run would replay or skip batches. The "
                "loader's position was restored from a checkpoint in a way LifeSeqDataModule does not handle (a loader "
                "built outside the DataModule, or a checkpoint without its state): resume with "
                "trainer.fit(model, datamodule=dm, ckpt_path=...)")


class LifeSeqDataModule(LifeSeqDataHooks, L.LightningDataModule):
    """A dataset's train / val / predict batches for a ``lightning`` Trainer, resumable mid-epoch
    (:class:`LifeSeqDataHooks` documents its arguments; ``lifeseq_shards.pl`` has the ``pytorch_lightning`` one)."""
