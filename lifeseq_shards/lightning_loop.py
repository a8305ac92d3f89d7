"""Every read or write of Lightning's training-loop internals, in one adapter: the fit loop's batch progress counters,
its data fetcher, and Lightning 2.2's missing restart stages. None of these is public API; each is used here only.

Tested on Lightning 2.2.2 (``lightning`` and ``pytorch_lightning``, the researchers' pins: constraints-pinned.txt)
and 2.6.6 (the newest installed: both packages) by tests/test_datamodule.py and tests/reader/test_ddp_elastic.py.
What they rely on, the same in both: ``trainer.fit_loop.epoch_loop.batch_progress`` (``current`` and ``total``
with ``ready``, ``started``, ``processed``, ``completed``; ``is_last_batch``; ``increment_completed()``),
``epoch_loop.restarting``, ``epoch_loop.reset()`` (called by ``epoch_loop.run`` before ``on_run_start``, which
adds ``current.ready`` to the data fetcher's count, and before the first batch is fetched and numbered ``batch_idx =
current.ready``), and ``epoch_loop._batches_that_stepped``. 2.2 has no restart stages
(``restarted_on_train_batch_end``, which later versions have): :func:`finish_saved_batch_on_restart` gives it one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _epoch_loop(trainer: Any) -> Any:
    return trainer.fit_loop.epoch_loop


def batches_ready(trainer: Any) -> int:
    """The batches of the current epoch the trainer has begun (those before the one now in hand)."""
    return int(_epoch_loop(trainer).batch_progress.current.ready)


def batches_unfinished(trainer: Any, handed: int) -> int:
    """Of ``handed`` batches of the current epoch a loader has handed out, those Lightning trains again on resume.
    A checkpoint saved inside a training batch (Lightning's SLURM requeue handler saves on SIGUSR1 wherever the step
    stands) resumes by training that batch again (``batch_progress.reset_on_restart``: back to the completed count);
    saved in ``on_train_batch_end`` (processed, not yet completed), after it."""
    p = _epoch_loop(trainer).batch_progress.current
    on_batch_end = p.ready == p.started == p.processed == p.completed + 1  # RESTARTED_ON_TRAIN_BATCH_END
    return max(0, handed - (p.processed if on_batch_end else p.completed))


def renumber(trainer: Any, epoch: int, then: int, now: int) -> None:
    """Move the trainer's count of ``epoch``'s batches from ``then`` to ``now`` (a rest of the epoch resumed in
    another arrangement runs from batch ``now`` to this arrangement's ``num_training_batches``), when the trainer stands
    at ``then`` of that epoch. Called from :func:`after_restart_reset`'s hook: the data fetcher's count of the epoch's
    batches (which tells its last) and the first batch's ``batch_idx`` are taken from this count after it."""
    progress = _epoch_loop(trainer).batch_progress.current
    if trainer.current_epoch != epoch or progress.ready != then:
        return  # not where the checkpoint left the trainer: the caller's position check says so
    progress.ready = progress.started = progress.processed = progress.completed = now


def after_restart_reset(trainer: Any, hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the training epoch loop has been reset, before it fetches and numbers a batch: on a
    restart that is where the restored count stands where the epoch goes on (rolled back to the batches completed,
    :func:`finish_saved_batch_on_restart`'s on 2.2). No hook of Lightning's runs there, and the first batch's
    ``batch_idx`` (the progress bar's count) is taken before ``on_after_batch_transfer``. Installs itself once; a
    later call replaces the hook."""
    loop = _epoch_loop(trainer)
    if getattr(loop, "_lifeseq_after_reset", None) is None:
        reset = loop.reset

        def reset_then_hook() -> None:
            reset()
            loop._lifeseq_after_reset()

        loop.reset = reset_then_hook
    loop._lifeseq_after_reset = hook


def finish_saved_batch_on_restart(trainer: Any) -> None:
    """Make a Lightning whose training epoch loop has no restart stages (2.2; ``restarted_on_train_batch_end`` came
    later) resume after the batch a checkpoint was saved at the end of, as later Lightnings do.

    A checkpoint saved in ``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps=...)``) holds that batch's
    optimizer and scheduler step but counts the batch as processed, not completed; such a Lightning restarts by
    rolling back to the completed count, so it would train that batch again and count every later batch one short
    (validation at the epoch's end skipped). Here the batch is completed before that roll-back, as later Lightnings
    do, and a checkpoint at the end of an epoch's last batch, whose next epoch such a Lightning cannot begin from
    there, is refused. Called with ``trainer``'s loop about to be restored; installs itself once."""
    epoch_loop = _epoch_loop(trainer)
    if hasattr(epoch_loop, "restarted_on_train_batch_end") or getattr(epoch_loop, "_lifeseq_restart", False):
        return
    reset = epoch_loop.reset

    def reset_after_saved_batch() -> None:
        progress = epoch_loop.batch_progress
        p = progress.total
        if epoch_loop.restarting and p.ready == p.started == p.processed == p.completed + 1:
            if progress.current.completed + 1 >= epoch_loop.trainer.num_training_batches:
                raise RuntimeError("this checkpoint was saved at the end of an epoch's last batch, and this "
                                   "Lightning cannot resume from it without training that batch twice: resume from "
                                   "the checkpoint at the epoch's end (ModelCheckpoint(save_on_train_epoch_end=True)"
                                   "), or upgrade lightning / pytorch_lightning (2.6 resumes from it)")
            progress.increment_completed()
            epoch_loop._batches_that_stepped += 1  # as the step's own end would have
        reset()

    epoch_loop.reset = reset_after_saved_batch
    epoch_loop._lifeseq_restart = True
