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
:class:`SigtermInterrupt`, a KeyboardInterrupt:
Lightning's Ctrl-C path, which runs no collective, ends the ranks it started, tears the loaders down and exits 1.
Lightning puts its own handlers back when the fit ends. A rank blocked in a collective when the signal comes
raises once the collective returns, which it does when the peer that left closes its connection. Lightning's
handler still answers a SIGTERM in the moment between setting it and the first stage (a barrier, before any
loader starts).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import lightning as L


class SigtermInterrupt(KeyboardInterrupt):
    """SIGTERM, raised in the main thread wherever it stands (Lightning handles it as it handles Ctrl-C)."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise SigtermInterrupt(f"signal {signum} (SIGTERM): stopping as on Ctrl-C")


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


class StopOnSigterm(SigtermHooks, L.pytorch.Callback):
    """:class:`SigtermHooks` for a ``lightning`` Trainer: ``Trainer(callbacks=[StopOnSigterm()])``."""
