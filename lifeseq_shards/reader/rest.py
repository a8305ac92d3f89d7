"""What ``shardify plan --resume`` says: the rest of a checkpoint's epoch in another arrangement or budget, as
:class:`~lifeseq_shards.reader.loader.ShardedLoader` would read it after loading that checkpoint. A refusal
(:class:`RestRefused`) is one line naming the flags given, in the user's words, never a setting the user left out."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from .dataset import ShardedDataset
from .launch import World
from .loader import DatasetChanged, ShardedLoader
from .state import EpochReadChanged, read_state


class RestRefused(ValueError):
    """The checkpoint cannot be planned as asked: the message says why and what to pass instead."""


def rest_of_epoch(root: str, checkpoint: str, world: int, workers: int, batch_size: int | None, drop_last: bool,
                  tokens_per_batch: int | None, balance: str) -> tuple[str, int]:
    """The rest of ``checkpoint``'s epoch on ``world`` ranks x ``workers`` (of batches of ``batch_size`` persons, the
    checkpoint's when not given, or of ``tokens_per_batch`` tokens) and the exit status ``shardify plan`` gives it: 1
    when someone is left out of the rest, else 0."""
    try:
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as e:
        raise RestRefused(f"{checkpoint}: not a checkpoint torch can load ({type(e).__name__}: {e})") from None
    try:
        state = read_state(saved, checkpoint)
    except ValueError as e:
        raise RestRefused(str(e)) from None
    then = state.arrangement
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the static-balance and resume warnings: the report says it all
        ds = ShardedDataset(root, split=state.split, batch_size=batch_size or then["batch_size"], world=World(0, world),
                            num_workers=workers, seed=then["seed"], shuffle=then["shuffle"], drop_last=drop_last,
                            tokens_per_batch=tokens_per_batch, balance=balance, crop=then.get("crop") or None)
        loader = ShardedLoader(ds)
        try:
            loader.load_state_dict(saved)
        except EpochReadChanged:
            raise RestRefused(f"{checkpoint}: epoch {state.position.epoch} was read {_read_by(then)} up to the "
                              f"checkpoint, and so is the rest of it: plan it {_read_by(then)}, or without --resume "
                              "for the next epoch") from None
        except (ValueError, DatasetChanged) as e:
            raise RestRefused(str(e)) from None
    at = loader.position
    if not at.history:  # the checkpoint's own arrangement, or nothing of the epoch trained yet
        return (f"{', '.join(then['split'])} split: resumes at batch {at.batches} of epoch {at.epoch}, as an ordinary "
                "epoch of this layout", 0)
    text, ok = ds.plan.describe_rest(at, ", ".join(then["split"]))
    return text, 0 if ok else 1


def _read_by(arrangement: dict[str, Any]) -> str:
    """How a saved arrangement's epoch was read, as `shardify plan`'s flags say it."""
    if not arrangement.get("tokens_per_batch"):
        return f"with --batch-size {arrangement['batch_size']} (without --tokens-per-batch)"
    return f"with --tokens-per-batch {arrangement['tokens_per_batch']}" + (
        " --attention" if arrangement.get("balance") == "attention" else " (without --attention)")
