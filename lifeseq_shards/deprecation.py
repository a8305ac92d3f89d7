"""Old public names that keep working: each use warns with :class:`LifeSeqDeprecationWarning`, naming the new one.

One warning class, so that the test suite turns every use of an old name inside the project into an error
(pyproject's ``filterwarnings``) while users' code only sees a warning.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


class LifeSeqDeprecationWarning(DeprecationWarning):
    """A lifeseq_shards name or value that still works but has a new name."""


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (the caller's caller is blamed by default)."""
    warnings.warn(f"{old} is deprecated: use {new}", LifeSeqDeprecationWarning, stacklevel=stacklevel)


def module_aliases(module: str, aliases: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` serving old names: ``aliases`` maps each to ``"package.module:new_name"``."""

    def __getattr__(name: str) -> object:  # noqa: N807 (the module hook's name)
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target, _, attr = aliases[name].partition(":")
        warn(f"{module}.{name}", f"{target}.{attr}")
        return getattr(importlib.import_module(target), attr)

    return __getattr__
