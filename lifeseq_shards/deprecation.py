"""Old public call forms that keep working a while: each use warns with :class:`LifeSeqDeprecationWarning`, naming
the new form, and the CHANGELOG says when it goes.

One warning class, so that the test suite turns every use of an old form inside the project into an error
(pyproject's ``filterwarnings``) while the researchers' code only sees a warning (``-W error::...`` finds them all).
"""

from __future__ import annotations

import warnings


class LifeSeqDeprecationWarning(DeprecationWarning):
    """A lifeseq_shards call form that still works but has a new one."""


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (the caller's caller is blamed by default)."""
    warnings.warn(f"{old} is deprecated: use {new}", LifeSeqDeprecationWarning, stacklevel=stacklevel)
