"""The loader's checkpoint state: its format, read and written here only.

Contract: ``ShardedLoader.state_dict()`` is a plain dict of built-in values (no tensors, no classes, so any
checkpoint stores it): ``version`` (this format's number, :data:`VERSION`; a state without it is version 1, saved
before the key existed, and reads the same), ``fingerprint`` (the dataset's), ``split`` (as the dataset was given
it: written, never read, so that an earlier install still reads a newer state), ``epoch`` and ``batches`` (the next
pass starts after ``batches`` batches of ``epoch``, in the saving arrangement's numbering), ``layout`` (every setting
that decides which persons a position holds: the splits read, the readers of
:data:`~lifeseq_shards.plan.resume.ARRANGEMENT_KEYS` and the order of :data:`FIXED_KEYS`, the mode under its pre-rename
name, ``plan.partition.STORED_MODE``, which every version writes) and, only in an epoch resumed from another
arrangement, ``history`` (the legs that read its start, oldest first), and, only when the epoch before left out
persons the
arrangement reading this epoch's start would not have, ``left_out_before`` (those persons, which this epoch reads:
``Position.left_out_before``). A token-budget reader's state (``tokens_per_batch``, :mod:`lifeseq_shards.plan.tokens`)
records in its arrangement and legs ``tokens_per_batch`` and, in its arrangement, ``balance`` (what the deal evens
out) and ``crop`` (the most tokens a person is counted for), and
is version 5 (4 before the digest, read as before; 3 before a fix of the slot edges: refused inside an epoch), which
an install that predates the budget refuses instead of resuming in another order; a state
without them reads as batches of persons (version 2 is still written for those, key for key as before, and
``digest``). ``digest``: the sha256 of every other key and value (:func:`state_digest`), so that a state edited by
hand or damaged is refused in one line instead of read (a budget's ``tokens_per_batch`` edited read persons twice);
a version 5 state must have one, and a state of an earlier version without one was saved before it and reads as
before. It is a check against edits and damage, not a signature: whoever edits a state on purpose can write its
digest again.
:func:`read_state` takes such a state or any dict that holds exactly one (a whole
Lightning checkpoint, a plain loop's, :func:`find_states`), and refuses anything else in one line naming the key or
value (:class:`StateError`): a state is never guessed at. :func:`arrangement_changes` says whether it resumes in its own
arrangement or in another (the rest of its epoch, :mod:`lifeseq_shards.plan.resume`), and refuses another order of the
epoch's persons (split, seed, mode, shuffle) or a state too old to say which it had.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import partition as plan
from ..plan.balance import BALANCES
from ..plan.partition import Partition
from ..plan.resume import ARRANGEMENT_KEYS, Arrangement, Leg, Position

# 1: the states saved before the version key; 2: the same keys, and ``version``; 3: token budgets; 4: token budgets
# whose slot edges cut a window's places consistently (a version 3 position inside an epoch means another plan); 5:
# token budgets with the state's digest (which states of every version now carry)
VERSION = 5
DIGEST_VERSION = 5  # the first version whose states must carry a digest
PERSONS_VERSION = 2  # what a state of batches of persons is written as: every version since reads it
# keys a state without them holds as these values (written only when they differ: a budget's state)
OPTIONAL = {"tokens_per_batch": 0, "balance": "tokens", "crop": 0}
# what a token budget's plan depends on beside the readers: kept throughout an epoch read with a budget (the loader)
BUDGET_KEYS = ("balance", "crop")
# the Partition's fields a saved state records beside the readers (its shard sizes and remainder are the dataset's,
# which the fingerprint covers)
FIXED_KEYS = ("seed", "mode", "shuffle")
# (key, what it must be, its check) of an arrangement's readers and order, and of a leg's batches
_NATURAL = "an integer >= 0"
_POSITIVE = "an integer >= 1"
_FLAG = "True or False"
_CHECKS: dict[str, tuple[str, Any]] = {
    "world_size": (_POSITIVE, lambda v: _is_int(v) and v >= 1),
    "num_workers": (_NATURAL, lambda v: _is_int(v) and v >= 0),
    "batch_size": (_POSITIVE, lambda v: _is_int(v) and v >= 1),
    "drop_last": (_FLAG, lambda v: isinstance(v, (bool, np.bool_))),
    "window": (_POSITIVE, lambda v: _is_int(v) and v >= 1),
    "batches_per_message": (_POSITIVE, lambda v: _is_int(v) and v >= 1),
    "tokens_per_batch": (_NATURAL, lambda v: _is_int(v) and v >= 0),
    "balance": ("one of " + ", ".join(map(repr, BALANCES)), lambda v: v in BALANCES),
    "crop": (_NATURAL, lambda v: _is_int(v) and v >= 0),
    "seed": (_NATURAL, lambda v: _is_int(v) and v >= 0),
    "mode": ("one of " + ", ".join(map(repr, sorted(set(plan.STORED_MODE.values())))),
             lambda v: v in plan.STORED_MODE.values()),
    "shuffle": (_FLAG, lambda v: isinstance(v, (bool, np.bool_))),
    "split": ("a non-empty list of split names", lambda v: isinstance(v, (list, tuple)) and len(v) > 0
              and all(isinstance(s, str) for s in v)),
    "batches": (_NATURAL, lambda v: _is_int(v) and v >= 0),
    "epoch": (_NATURAL, lambda v: _is_int(v) and v >= 0),
}
_TOP = ("fingerprint", "epoch", "batches", "layout")  # what every version holds (``split`` is never read)
# every refusal of a position that cannot be resumed exactly ends so: what each front end does to start it over
START_OVER = ("start the epoch over: restart_epoch=True on LifeSeqDataModule or LifeSeqData, or set_epoch(epoch) "
              "on a ShardedLoader instead of load_state_dict (docs/guides/resume.md)")


class StateError(ValueError):
    """A checkpoint's loader state that is not one, or is damaged: the message names the key or value."""


class DatasetChanged(RuntimeError):
    """A resume state was saved for another dataset (its fingerprint differs)."""


class EpochReadChanged(ValueError):
    """A resume inside an epoch read by persons on one side and by a token budget on the other, or by a budget of
    another balance or crop: the message names those settings only (another arrangement alone is resumed)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def saved_arrangement(partition: Partition, split: Sequence[str], batches_per_message: int, tokens_per_batch: int = 0,
                 balance: str = "tokens", crop: int = 0) -> dict[str, Any]:
    """Every setting that decides which persons a position in the epoch holds, as a state stores them: the splits,
    the partition's readers (:data:`ARRANGEMENT_KEYS`) and its order (:data:`FIXED_KEYS`, the mode under its stored
    name); a token budget's ``tokens_per_batch``, ``balance`` and ``crop`` only where there is one
    (:data:`OPTIONAL`)."""
    arrangement = _stored(Arrangement.of_partition(partition, batches_per_message, tokens_per_batch))
    fixed = {k: getattr(partition, k) for k in FIXED_KEYS}
    budget = {"balance": balance, "crop": crop} if tokens_per_batch else {}
    return {"split": list(split), **arrangement, **fixed, "mode": plan.STORED_MODE[partition.mode], **budget}


def _stored(arrangement: Arrangement) -> dict[str, Any]:
    """An arrangement's keys as a state stores them: ``tokens_per_batch`` only when there is a budget."""
    values = dataclasses.asdict(arrangement)
    if not arrangement.tokens_per_batch:
        del values["tokens_per_batch"]
    return values


def saved_state(fingerprint: str, split: str | Sequence[str], arrangement: dict[str, Any],
                position: Position) -> dict[str, Any]:
    """A loader's checkpoint state (the module's contract): ``history`` and ``left_out_before`` only where the
    position has them, so that an ordinary epoch's state holds the keys it always held, and ``version``."""
    version = VERSION if arrangement.get("tokens_per_batch") else PERSONS_VERSION
    keys = _position_keys(position)
    state: dict[str, Any] = {"version": version, "fingerprint": fingerprint, "split": split,
                             "epoch": keys.pop("epoch"), "batches": keys.pop("batches"), "layout": arrangement, **keys}
    return {**state, "digest": state_digest(state)}


def _position_keys(position: Position) -> dict[str, Any]:
    """A position's keys as a state holds them: ``epoch``, ``batches``, and ``history`` and ``left_out_before``
    only where the position has them."""
    keys: dict[str, Any] = {"epoch": position.epoch, "batches": position.batches}
    if position.history:
        keys["history"] = [{**_stored(leg.arrangement), "batches": leg.batches} for leg in position.history]
    if position.left_out_before:
        keys["left_out_before"] = list(position.left_out_before)
    return keys


def position_text(position: Position) -> str:
    """A position as a state holds its keys, in JSON: how the dataset hands it to its workers
    (:mod:`lifeseq_shards.reader.control`), read back by :func:`position_of`."""
    return json.dumps(_position_keys(position), separators=(",", ":"), default=lambda v: v.item())


def position_of(text: str) -> Position:
    """The position :func:`position_text` wrote (written by this process, so not checked again)."""
    keys = json.loads(text)
    return Position(keys["epoch"], keys["batches"], _legs(keys.get("history", [])),
                    tuple(keys.get("left_out_before", ())))


def state_digest(state: dict[str, Any]) -> str:
    """The sha256 of a state's keys and values but ``digest`` (JSON, keys sorted; numpy scalars as their values)."""
    rest = {k: v for k, v in state.items() if k != "digest"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), default=lambda v: v.item())
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class SavedState:
    """A checked loader state: the dataset's fingerprint, the saving arrangement as stored, and the position."""

    fingerprint: str
    arrangement: dict[str, Any]
    position: Position

    @property
    def leg(self) -> Leg:
        """The saving arrangement and the batches it took (the last leg, when the next pass is in another
        arrangement)."""
        return Leg(Arrangement.of([self.arrangement[k] for k in ARRANGEMENT_KEYS]), self.position.batches)

    @property
    def split(self) -> str | tuple[str, ...]:
        """The split as a dataset takes it (one name, or the names read together)."""
        names = self.arrangement["split"]
        return names[0] if len(names) == 1 else tuple(names)


def _looks_like_state(value: Any) -> bool:
    """A dict with a key only a loader state has (a Lightning checkpoint has an ``epoch`` too): read (and
    checked) as one, not searched."""
    return isinstance(value, dict) and any(k in value for k in ("fingerprint", "layout"))


def find_states(saved: Any) -> list[tuple[str, dict[str, Any]]]:
    """The loader states ``saved`` holds, each with the keys that lead to it (``""`` for ``saved`` itself, else
    e.g. ``['LifeSeqDataModule']['train']``): itself (a file of ``ShardedLoader.state_dict()``), its ``"train"``
    entry (``LifeSeqData.state_dict()`` saved alone), or such an entry one level down under any key (Lightning files
    the DataModule's under its class name, a plain loop under its own, e.g. ``"data"``)."""
    if _looks_like_state(saved):
        return [("", saved)]
    if not isinstance(saved, dict):
        return []
    entries = [("", saved), *((f"[{k!r}]", v) for k, v in saved.items() if isinstance(v, dict))]
    return [(f"{path}['train']", e["train"]) for path, e in entries if _looks_like_state(e.get("train"))]


def read_state(saved: Any, source: str) -> SavedState:
    """The loader state ``saved`` is or holds (:func:`find_states`), checked; :class:`StateError` names what is
    wrong, after ``source`` (the file or dataset the message is about)."""
    found = find_states(saved)
    if not found:
        kind = f"a {type(saved).__name__}" if not isinstance(saved, dict) else "a dict of " + (
            ", ".join(map(repr, list(saved)[:6])) or "nothing")
        raise StateError(f"{source}: holds no loader states (got {kind}): pass ShardedLoader.state_dict(), "
                         "LifeSeqData.state_dict(), or a checkpoint holding one (a Lightning checkpoint of a "
                         "LifeSeqDataModule fit)")
    if len(found) > 1:
        raise StateError(f"{source}: holds {len(found)} loader states ({', '.join(p for p, _ in found)}): pass the "
                         f"one to resume, e.g. checkpoint{found[0][0]}")
    where, state = found[0]
    return _checked(state, f"{source}: the checkpoint's loader state{' ' + where if where else ''}")


def _checked(state: dict[str, Any], said: str) -> SavedState:
    version = state.get("version", 1)
    if not (_is_int(version) and 1 <= version <= VERSION):
        raise StateError(f"{said} has version {version!r}, and this lifeseq_shards reads versions 1 to {VERSION}"
                         + (": upgrade lifeseq_shards" if _is_int(version) and version > VERSION else ""))
    missing = [k for k in _TOP if k not in state]
    if version == 3 and (state.get("batches") or state.get("history")):
        raise StateError(f"{said} has version 3: a token budget's position inside epoch {state.get('epoch')!r} "
                         "planned by an earlier lifeseq_shards, whose slot edges cut some windows otherwise, so "
                         "resuming it here would read another plan; finish the epoch with that version, or "
                         + START_OVER)
    if missing:
        raise StateError(f"{said} has no {', '.join(map(repr, missing))}: it is damaged, or not a loader state")
    if not isinstance(state["fingerprint"], str):
        raise StateError(f"{said} has fingerprint {state['fingerprint']!r}, not a string")
    for key in ("epoch", "batches"):
        _check_value(state, key, said)
    arrangement = state["layout"]
    if not isinstance(arrangement, dict):
        raise StateError(f"{said} has layout {arrangement!r}, not a dict")
    arrangement = {**OPTIONAL, **arrangement}
    old = [k for k in ("split", *ARRANGEMENT_KEYS, *FIXED_KEYS) if k not in arrangement]
    if old:
        raise StateError(f"cannot resume exactly: the checkpoint's loader state does not record {', '.join(old)} "
                         "(saved by an older lifeseq_shards), so it may have read in another order; " + START_OVER)
    for key in ("split", *ARRANGEMENT_KEYS, *FIXED_KEYS, *BUDGET_KEYS):
        _check_value(arrangement, key, said, "layout")
    history = state.get("history", [])
    if not isinstance(history, list):
        raise StateError(f"{said} has history {history!r}, not a list of legs")
    given, history = history, [{**OPTIONAL, **s} if isinstance(s, dict) else s for s in history]
    for i, leg in enumerate(history):
        if not isinstance(leg, dict) or any(k not in leg for k in (*ARRANGEMENT_KEYS, "batches")):
            raise StateError(f"{said} has history[{i}] {given[i]!r}, not a leg (the "
                             f"{', '.join(ARRANGEMENT_KEYS)} and batches of an arrangement)")
        for key in (*ARRANGEMENT_KEYS, "batches"):
            _check_value(leg, key, said, f"history[{i}]")
    before = state.get("left_out_before", [])
    if not (isinstance(before, list) and all(_is_int(p) and p >= 0 for p in before)):
        raise StateError(f"{said} has left_out_before {before!r}, not a list of person numbers")
    # last: a value out of shape is named above; one that is well formed but not as saved (an edit) only here
    digest = state.get("digest")
    if digest is not None or version >= DIGEST_VERSION:
        try:
            same = digest == state_digest(state)
        except (TypeError, AttributeError):  # a value JSON cannot hold: not what saved_state wrote
            same = False
        if not same:
            raise StateError(f"{said} does not match its digest: it was edited or damaged after it was saved; "
                             "resume from the checkpoint as saved, or " + START_OVER)
    position = Position(int(state["epoch"]), int(state["batches"]), _legs(history),
                        tuple(sorted(int(p) for p in before)))
    return SavedState(state["fingerprint"], arrangement, position)


def _legs(history: list[dict[str, Any]]) -> tuple[Leg, ...]:
    """The legs of a state's ``history`` (a budget's keys as :data:`OPTIONAL` where a leg has none)."""
    return tuple(Leg(Arrangement.of([{**OPTIONAL, **s}[k] for k in ARRANGEMENT_KEYS]), int(s["batches"])) for s in
    history)


def saved_epoch(saved: Any, source: str) -> tuple[int, int]:
    """(epoch, batches) of the loader state ``saved`` is or holds, for starting that epoch over: only those two
    are checked, since the rest (another budget, an older version, an edit) is what made the position unusable."""
    found = find_states(saved)
    if len(found) != 1:
        read_state(saved, source)  # its one-line refusal: no state, or several
    where, state = found[0]
    said = f"{source}: the checkpoint's loader state{' ' + where if where else ''}"
    for key in ("epoch", "batches"):
        if key not in state:
            raise StateError(f"{said} has no {key!r}: it is damaged, or not a loader state")
        _check_value(state, key, said)
    return int(state["epoch"]), int(state["batches"])


def _check_value(values: dict[str, Any], key: str, said: str, within: str = "") -> None:
    """``values[key]`` as the format has it, else StateError naming it (``within``: the entry holding it)."""
    what, ok = _CHECKS[key]
    if not ok(values[key]):
        name = f"{within}[{key!r}]" if within else key
        raise StateError(f"{said} has {name} {values[key]!r}, not {what}")


def arrangement_changes(now: dict[str, Any], saved: SavedState, root: str, mode: str) -> list[str]:
    """What of the readers changed since ``saved`` (empty: its own arrangement), each as ``"key old -> new"``, between
    the arrangement ``now`` of a ``mode`` dataset at ``root`` and the saved one. Another order of the epoch's persons
    (split, seed, mode, shuffle) is refused, and another arrangement of a pass whose ranks have unequal lengths."""
    then, now = saved.arrangement, {**OPTIONAL, **now}
    # what a token budget's plan depends on, which only a resume inside such an epoch must keep (the loader)
    fixed = [f"{k} {then[k]!r} -> {now[k]!r}" for k in now
             if k not in (*ARRANGEMENT_KEYS, *BUDGET_KEYS) and then[k] != now[k]]
    if fixed:
        raise ValueError(f"{root}: cannot resume exactly: {'; '.join(fixed)} since the checkpoint (another "
                         "split, or another order of its persons); resume with the checkpoint's settings, or "
                         + START_OVER)
    changed = [f"{k} {then[k]!r} -> {now[k]!r}" for k in ARRANGEMENT_KEYS if then[k] != now[k]]
    if changed and mode != plan.EVEN:
        raise ValueError(f"{root}: cannot resume exactly: {'; '.join(changed)} since the checkpoint, and a "
                         f"{mode} pass (ranks of unequal lengths) resumes only in its own arrangement")
    return changed


def budget_changes(now: dict[str, Any], saved: SavedState) -> list[str]:
    """What a token budget's plan depends on beside the readers (:data:`BUDGET_KEYS`) that changed since ``saved``,
    each as ``"key old -> new"``: only between two budgets (an arrangement of batches of persons stores none)."""
    then, now = saved.arrangement, {**OPTIONAL, **now}
    both = then["tokens_per_batch"] and now["tokens_per_batch"]
    return [f"{k} {then[k]!r} -> {now[k]!r}" for k in BUDGET_KEYS if both and then[k] != now[k]]


def kept_changes(now: dict[str, Any], saved: SavedState) -> list[str]:
    """What must stay throughout an epoch but changed since ``saved``: whether it is read by persons or by a budget
    (``tokens_per_batch``), and a budget's :func:`budget_changes`; each as ``"key old -> new"``."""
    then, now = saved.arrangement, {**OPTIONAL, **now}
    switched = (then["tokens_per_batch"] == 0) != (now["tokens_per_batch"] == 0)
    kind = [f"tokens_per_batch {then['tokens_per_batch']!r} -> {now['tokens_per_batch']!r}"] if switched else []
    return [*kind, *budget_changes(now, saved)]
