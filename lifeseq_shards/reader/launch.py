"""This process's :class:`World` (its rank of the world size) when nobody passed one: torch.distributed, else what
the launcher that started it wrote into its environment.

Launchers nest (torchrun under srun, mpirun's daemons started by srun), and the innermost knows best, so the
variables are asked in three tiers: torchrun's ``RANK`` / ``WORLD_SIZE``; an MPI launcher's (Open MPI's
``OMPI_COMM_WORLD_*``, MPICH's and Intel MPI's ``PMI_*``, MVAPICH2's ``MV2_COMM_WORLD_*``, LSF jsrun's
``JSM_NAMESPACE_*``); srun's ``SLURM_PROCID`` / ``SLURM_NTASKS``. Within a tier every pair that is set must agree;
an inner tier's world must be at least an outer one's (each outer task runs one or more inner processes: fewer
means stale variables, and processes that each read everything). Slurm's variables count only in a task that
srun started: a batch script inherits ``SLURM_NTASKS`` of the job (and ``SLURM_PROCID=0``) while it is one
process, and has no step id (``SLURM_STEP_ID``) or the batch or interactive step's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral

import torch

TORCHRUN = (("RANK", "WORLD_SIZE"),)
MPI = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
       ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"))
SLURM = (("SLURM_PROCID", "SLURM_NTASKS"),)
TIERS = (TORCHRUN, MPI, SLURM)
LAUNCHER_VARS = tuple(pair for tier in TIERS for pair in tier)  # every (rank, world size) pair, innermost first
STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")  # srun sets both in every task it starts
# Slurm's ids of the steps that are no srun task (SLURM_BATCH_SCRIPT and the other special steps are the
# largest 32-bit values: 0xfffffffa and up in Slurm 22.05+, 0xfffffffd and up before)
SPECIAL_STEPS = 0xFFFFFFFA

Found = tuple[int, int, str, str]  # rank, world size, and the variables they came from


class LaunchError(RuntimeError):
    """The environment does not say which part of the data is this process's; the message is one line."""


@dataclass(frozen=True)
class World:
    """Which part of the data is this process's: rank ``rank`` of the ``size`` processes that split it (the
    data-parallel ranks). Built once per process, by hand or by :meth:`current`, and handed to every dataset, so
    that DataLoader workers (where torch.distributed is not initialised and RANK may be unset) cannot lose it."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        for name, value, least in (("rank", self.rank, 0), ("size", self.size, 1)):
            if not isinstance(value, Integral) or isinstance(value, bool) or value < least:
                raise ValueError(f"World: {name} must be an integer >= {least}, not {value!r}")
        if self.rank >= self.size:
            raise ValueError(f"World: rank {self.rank} outside world size {self.size} (ranks are 0..{self.size - 1})")

    @classmethod
    def current(cls) -> World:
        """torch.distributed when initialised, else the innermost launcher's variables (the module's docstring),
        else a single process. Refuses, naming the variables: a rank without its world size or the reverse (rank
        0 of 1 would read everything), a value that is no count, a rank outside its world, two launchers that
        disagree, and Slurm's job variables in a process that srun did not start (the batch script would read
        1/SLURM_NTASKS of the data)."""
        return cls(*_launched())


def _launched() -> tuple[int, int]:
    """(rank, world size) as :meth:`World.current` finds them."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    environ = os.environ
    found = [_tier(environ, tier) for tier in TIERS]
    if found[-1] is not None and not _srun_task(environ):
        if not any(found[:-1]):  # the batch script itself, not torchrun or mpirun started from it
            _refuse_batch_script(found[-1])
        found[-1] = None  # the job's, not this process's
    outer: Found | None = None
    for f in reversed(found):
        if f is None:
            continue
        if outer is not None and f[1] < outer[1]:
            raise LaunchError(f"{f[3]}={f[1]} but {outer[3]}={outer[1]}: fewer processes than the launcher around it "
                              f"started (stale variables?), and each would read more than its share. Unset "
                              f"{f[2]} / {f[3]}, or pass world=World(rank, size) to ShardedDataset")
        outer = f
    return (outer[0], outer[1]) if outer is not None else (0, 1)


def _tier(environ: Mapping[str, str], tier: tuple[tuple[str, str], ...]) -> Found | None:
    """The tier's (rank, world, variables), every pair set in it agreeing; None when it sets none."""
    got: Found | None = None
    for rank_var, world_var in tier:
        pair = _pair(environ, rank_var, world_var)
        if pair is None:
            continue
        if got is not None and got[:2] != pair[:2]:
            raise LaunchError(f"{got[2]}={got[0]} {got[3]}={got[1]} but {rank_var}={pair[0]} {world_var}={pair[1]}: "
                              "two launchers disagree about this process; unset the stale ones, or pass "
                              "world=World(rank, size) to ShardedDataset")
        got = got or pair
    return got


def _pair(environ: Mapping[str, str], rank_var: str, world_var: str) -> Found | None:
    rank_text, world_text = environ.get(rank_var), environ.get(world_var)
    if rank_text is None and world_text is None:
        return None
    if world_text is None:  # as a world of 1, rank 0 would read everything
        raise LaunchError(f"{rank_var}={rank_text} is set but {world_var} is not: the number of processes sharing the "
                          f"data is unknown. Set {world_var}, or pass world=World(rank, size) to ShardedDataset")
    world = _count(world_var, world_text, 1)
    if rank_text is None:
        if world == 1:
            return 0, 1, rank_var, world_var
        raise LaunchError(f"{world_var}={world} says there are {world} processes but {rank_var} is not set: this "
                          "process cannot tell which part of the data is its own. Launch with torchrun, srun or "
                          "mpirun, or pass world=World(rank, size) to ShardedDataset")
    rank = _count(rank_var, rank_text, 0)
    if rank >= world:
        raise LaunchError(f"{rank_var}={rank} is outside {world_var}={world} (ranks are 0..{world - 1})")
    return rank, world, rank_var, world_var


def _count(var: str, text: str, least: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < least:
        raise LaunchError(f"{var}={text!r} is not a whole number >= {least}; fix or unset it, or pass "
                          "world=World(rank, size) to ShardedDataset")
    return value


def _srun_task(environ: Mapping[str, str]) -> bool:
    step = next((environ[v] for v in STEP_VARS if v in environ), None)
    return step is not None and step.strip().isdigit() and int(step) < SPECIAL_STEPS


def _refuse_batch_script(found: Found) -> None:
    """Slurm's variables in the one process of a batch script: harmless for a one-task job, refused for more."""
    rank, world, rank_var, world_var = found
    if world > 1:
        raise LaunchError(f"{world_var}={world} counts the job's tasks, but this process was not started by srun "
                          f"(no {STEP_VARS[0]}: an sbatch script runs once), so {rank_var}={rank} would read "
                          f"1/{world} of the data alone. Start it with `srun python ...` (or torchrun), or pass "
                          "world=World(0, 1) to ShardedDataset to read everything here")
