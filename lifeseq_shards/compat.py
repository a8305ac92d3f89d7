"""What this torch and Lightning can do, detected where it is used rather than read off a version (the researchers
run torch 2.1.2 and Lightning 2.2.2; CI runs that stack and the newest). A fallback that gives the same result at
the same cost says nothing (on their stack every process and loader worker used to warn of the first two below, 20
warnings in one 2-rank fit, none asking anything of the user); one that costs something is named once a run, in one
line (a :class:`FallbackNotice` warning, by rank 0 the first time it is taken). Nothing here fails on import.

- Unsigned tensors (torch >= 2.3): before, torch has no uint16 / uint32 / uint64 dtype and ``torch.from_numpy``
  refuses such arrays. There a host array of one crosses as its signed view of the same width (the same bytes, so
  the same bus traffic), and :func:`unsigned` reads it back on the device, bit for bit.
- ``torch.serialization.add_safe_globals`` (torch >= 2.4), for ``weights_only`` loads: :func:`add_safe_globals`.
- FlashAttention's variable-length kernel (torch >= 2.10): :func:`varlen_kernel`.

Thread-local CUDA-graph capture (``capture_error_mode``) and ``torch.compile`` are in every supported torch (2.1+).
What Lightning's loop lacks (2.2's restart stages) is :mod:`lifeseq_shards.lightning_loop`'s, with every use of its
internals.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# The one table of the unsigned dtypes wider than 8 bits (torch < 2.3 has none of them): bits -> the signed view of
# the same width (the same bytes), and the signed dtype their values are widened to (a uint64's int64 view already
# is what `.long()` of a uint64 gives). Every other table of them is derived here.
_UNSIGNED_BITS = {16: (torch.int16, torch.int32), 32: (torch.int32, torch.int64), 64: (torch.int64, torch.int64)}
_SIGNED = {np.dtype(f"uint{bits}"): np.dtype(f"int{bits}") for bits in _UNSIGNED_BITS}
# a signed view widened one step
_WIDER = {view: wider for view, wider in _UNSIGNED_BITS.values() if view != wider}
# torch >= 2.3's unsigned dtypes -> (their signed view, their widened values)
UNSIGNED: dict[torch.dtype, tuple[torch.dtype, torch.dtype]] = {
    getattr(torch, f"uint{bits}"): views for bits, views in _UNSIGNED_BITS.items() if hasattr(torch, f"uint{bits}")}


class FallbackNotice(UserWarning):
    """A capability this torch lacks, and what is done instead (once per process and capability)."""


@functools.cache
def fallback(what: str, instead: str, where: str = f"torch {torch.__version__}") -> None:
    """Say once a run, in one line, that ``where`` has no ``what`` and ``instead`` is done, at some cost (rank 0
    says it: every rank takes the same fallback)."""
    if _rank() == 0:
        warnings.warn(f"lifeseq_shards: no {what} in {where}: {instead}", FallbackNotice, stacklevel=3)


def _rank() -> int:
    """This process's rank: torch.distributed's, else the launcher's (torchrun, srun), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


@functools.cache
def unsigned_tensors() -> bool:
    """Whether torch holds numpy's uint16 (and wider unsigned) arrays as tensors of the same dtype."""
    try:
        torch.from_numpy(np.zeros(1, dtype=np.uint16))
    except TypeError:
        return False
    return True


def host_dtype(dtype: np.dtype | str) -> np.dtype:
    """The numpy dtype a column of ``dtype`` has as a tensor: itself, or its signed view where torch lacks it."""
    dt = np.dtype(dtype)
    if dt in _SIGNED and not unsigned_tensors():  # the same bytes cross, read back bit for bit: nothing to say
        return _SIGNED[dt]
    return dt


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` (no copy), through the signed view of an unsigned array where torch lacks its dtype."""
    return torch.from_numpy(array.view(host_dtype(array.dtype)))


def torch_dtype(numpy_dtype: np.dtype | str) -> torch.dtype:
    """The torch dtype :func:`to_tensor` gives an array of ``numpy_dtype``."""
    return _torch_dtype(host_dtype(numpy_dtype).str)


@functools.cache
def _torch_dtype(numpy_dtype: str) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=numpy_dtype)).dtype


def is_view(stored: np.dtype | str) -> bool:
    """Whether a column stored as ``stored`` crosses as its signed view (:func:`to_tensor`)."""
    return host_dtype(stored) != np.dtype(stored)


def unsigned(view: torch.Tensor) -> torch.Tensor:
    """The unsigned values of a signed view (:func:`to_tensor`), bit-exact, in the next wider signed dtype."""
    wider = _WIDER.get(view.dtype)
    if wider is None:
        return view
    return view.to(wider) & ((1 << (8 * view.element_size())) - 1)


def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's variable-length kernel, torch >= 2.10), or None;
    :func:`lifeseq_shards.encoder.varlen_backend` names the fallback when it would have been used."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def add_safe_globals(classes: list[Any]) -> None:
    """Allow ``classes`` in ``torch.load(weights_only=True)``; without the allow-list (torch < 2.4) Lightning loads
    checkpoints with full unpickling, so nothing needs to be allowed."""
    register = getattr(torch.serialization, "add_safe_globals", None)
    if register is not None:  # else nothing to say: Lightning 2.2's and torch.load's default there is full unpickling
        register(classes)
