"""A SIGTERM (scancel, a Slurm time limit, a preemption) that ends a DDP fit the way Ctrl-C does, within seconds.

Lightning answers SIGTERM in a Python signal handler, which runs wherever the main thread stands when the signal
comes. From Lightning 2.5 (its pull request #20825, for issue #20806) that handler calls
``torch.distributed.broadcast``; in a DDP fit the main thread is often inside another collective then, so rank 0
broadcasts while rank 1 waits in the gradient all-reduce of its backward (or in a ``sync_dist`` all-reduce, or a
barrier), and both wait forever, until SIGKILL, which also leaves the loaders' semaphores in /dev/shm. Before that
change (2.2, the researchers' pin) a rank that raised ``SIGTERMException`` after its step could leave the others
waiting in the next step's all-reduce (issue #20806). Nothing of the data path is in these waits: each rank's
stack is Lightning's handler or DDP's collective.

:class:`StopOnSigterm` (``lifeseq_shards.pl.StopOnSigterm`` for ``pytorch_lightning``) replaces Lightning's SIGTERM
handler when a stage begins (the sanity check, training, a validation, a predict) with one that raises
:class:`Preempted`, a ``SystemExit`` with status :data:`PREEMPTED` (143). Lightning handles it as any exception
other than Ctrl-C: no collective, the callbacks' ``on_exception`` (this one's ends the ranks this process started,
as the Ctrl-C path does), the loaders torn down, and raised again, so the process ends with 143 and nothing after
``fit`` runs, on every Lightning version. Lightning's Ctrl-C path, which
an earlier version took, ends 2.2 (the researchers' pin) with ``fit`` returning, the script going on and the process
exiting 0, as a finished run does, and newer ones with 1, as a crash does: neither tells a job script to requeue.
143 is 128 + SIGTERM, the status a shell reports for a process the signal ended (a plain loop without a handler),
so one test in the job script covers both. A rank blocked in a collective when the signal comes raises once the
collective returns, which it does when the peer that left closes its connection. Lightning's handler still
answers a SIGTERM in the moment between setting it and the first stage (a barrier, before any loader starts).
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

import lightning as L

PREEMPTED = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM ended; a job script requeues on it


class Preempted(SystemExit):
    """SIGTERM, raised in the main thread wherever it stands: Lightning tears the fit down and raises it again, and
    the process exits with :data:`PREEMPTED`."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM would break off the teardown this one starts
    raise Preempted(PREEMPTED)


class SigtermHooks:
    """The callback hooks, shared by both Lightning packages' classes."""

    def _take_sigterm(self) -> None:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            signal.signal(signal.SIGTERM, _interrupt)

    # the first hook of each stage after Lightning set its handlers (the sanity check's runs before training's)
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._take_sigterm()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._take_sigterm()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._take_sigterm()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._take_sigterm()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not isinstance(exception, Preempted):
            return
        if trainer.global_rank == 0:
            print(f"SIGTERM: stopped, exit status {PREEMPTED} (preempted: requeue the job; it resumes from the last "
                  "checkpoint)", file=sys.stderr, flush=True)
        if trainer.strategy.launcher is not None:  # the ranks this process started, as Lightning's Ctrl-C path ends
            trainer.strategy.launcher.kill(signal.SIGKILL)  # them: a SIGTERM to this rank alone leaves none waiting


class StopOnSigterm(SigtermHooks, L.pytorch.Callback):
    """:class:`SigtermHooks` for a ``lightning`` Trainer: ``Trainer(callbacks=[StopOnSigterm()])``."""
