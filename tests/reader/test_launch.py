"""Rank and world size from the launchers' variables (lifeseq_shards/reader/launch.py) when a dataset is built
before torch.distributed is initialised: torchrun, srun, Open MPI, MPICH / Intel MPI (PMI), MVAPICH2, LSF jsrun;
a batch script outside srun; values that are no count; launchers that disagree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import trained_ids

from lifeseq_shards.reader import LaunchError, ShardedDataset, World
from lifeseq_shards.reader.launch import LAUNCHER_VARS, STEP_VARS

SRUN = {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0"}  # what srun sets in every task, beside SLURM_PROCID / NTASKS


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variable but those a test sets."""
    assert not torch.distributed.is_initialized()
    for var in (*(v for pair in LAUNCHER_VARS for v in pair), *STEP_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def launched(env: pytest.MonkeyPatch, variables: dict[str, str]) -> tuple[int, int]:
    for var, value in variables.items():
        env.setenv(var, value)
    world = World.current()
    return world.rank, world.size


@pytest.mark.parametrize(("variables", "want"), [
    ({}, (0, 1)),
    ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # torchrun
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2)),  # Open MPI's mpirun (was 0 of 1)
    ({"PMI_RANK": "2", "PMI_SIZE": "3"}, (2, 3)),  # MPICH / Intel MPI (hydra), srun --mpi=pmi2
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "4"}, (1, 4)),  # MVAPICH2
    ({"JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_SIZE": "6"}, (5, 6)),  # LSF jsrun
    # Open MPI sets PMIx's too, and a PMI launcher under srun agrees with Slurm's
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2)),
    ({**SRUN, "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "PMI_RANK": "3", "PMI_SIZE": "4"}, (3, 4)),
    ({**SRUN, "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, (3, 4)),  # srun
    ({"SLURM_STEPID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (1, 2)),  # an older srun's name only
    # torchrun under srun (one agent per node), mpirun whose daemons srun started: the inner launcher's world
    ({**SRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "6", "WORLD_SIZE": "8"}, (6, 8)),
    ({**SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"},
     (3, 8)),
    # an sbatch script: one process of a one-task job, or torchrun started from it (Slurm's variables are the job's)
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 1)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "RANK": "1", "WORLD_SIZE": "4"}, (1, 4)),
    ({"WORLD_SIZE": "1"}, (0, 1)),
])
def test_rank_and_world_from_the_launcher(env: pytest.MonkeyPatch, variables: dict[str, str],
                                          want: tuple[int, int]) -> None:
    assert launched(env, variables) == want


@pytest.mark.parametrize(("variables", "message"), [
    # a batch script outside srun: it was taken as rank 0 of 4 and read a quarter of the data alone
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 counts the job's tasks, but this process was not "
                                                 "started by srun"),
    ({"SLURM_STEP_ID": "4294967291", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "not started by srun"),  # batch step
    ({"SLURM_STEP_ID": "batch", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "not started by srun"),
    # values that are no count: int()'s "invalid literal" named no variable
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not a whole number >= 0"),
    ({**SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": ""}, "SLURM_NTASKS='' is not a whole number >= 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number >= 1"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK=2 is outside "
                                                                 "OMPI_COMM_WORLD_SIZE=2"),
    # several processes and no rank, or a rank without its world size
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2 says there are 2 processes but OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "1"}, "PMI_RANK=1 is set but PMI_SIZE is not"),
    # launchers that disagree, named both
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "2"},
     "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 but PMI_RANK=0 PMI_SIZE=2: two launchers disagree"),
    ({**SRUN, "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "RANK": "0", "WORLD_SIZE": "1"},  # a stale RANK under srun
     "WORLD_SIZE=1 but SLURM_NTASKS=4"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "1"},
     "WORLD_SIZE=1 but OMPI_COMM_WORLD_SIZE=2"),
])
def test_launcher_variables_that_cannot_work_are_refused_by_name(env: pytest.MonkeyPatch, variables: dict[str, str],
                                                                 message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")) as refused:
        launched(env, variables)
    assert "\n" not in str(refused.value)


def test_mpirun_ranks_each_read_their_own_persons(nomlm_dataset: Path, env: pytest.MonkeyPatch) -> None:
    """Two processes of `mpirun -n 2` build their datasets before init_process_group: each read every person (rank
    0 of 1) before; now each reads its half, and together every train person once."""
    got = []
    for rank in (0, 1):
        env.setenv("OMPI_COMM_WORLD_RANK", str(rank))
        env.setenv("OMPI_COMM_WORLD_SIZE", "2")
        ds = ShardedDataset(nomlm_dataset, batch_size=200)
        assert (ds.rank, ds.world_size) == (rank, 2)
        got.append(np.concatenate([b["person_id"].numpy() for b in ds]))
    assert not set(got[0].tolist()) & set(got[1].tolist())
    everyone, left = trained_ids(nomlm_dataset, 2, 0, 0)  # the persons 2 readers leave out of epoch 0
    assert sorted(np.concatenate(got).tolist()) == sorted(everyone - left)


def test_a_datamodule_outside_a_trainer_takes_the_launchers_rank(nomlm_dataset: Path, env: pytest.MonkeyPatch) -> None:
    """A plain loop over LifeSeqDataModule's loaders under torchrun: every rank took rank 0 of 1 and read everyone."""
    from lifeseq_shards import LifeSeqDataModule

    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    ds = LifeSeqDataModule(nomlm_dataset, batch_size=64, num_workers=0).train_dataloader().dataset
    assert (ds.rank, ds.world_size) == (1, 2)


@pytest.mark.parametrize(("rank", "size", "message"), [
    (2, 2, "rank 2 outside world size 2"), (-1, 2, "rank must be an integer >= 0"),
    (0, 0, "size must be an integer >= 1"), (True, 2, "rank must be an integer"), (0, 2.0, "size must be an integer"),
])
def test_a_world_outside_itself_is_refused(rank: object, size: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        World(rank, size)  # type: ignore[arg-type]


def test_a_world_is_whole_frozen_and_nothing_else_stands_for_it(tmp_path: Path) -> None:
    """Rank and size come together (a rank without its size would read as a world of one, reading everything),
    the value cannot change under the dataset that holds it, and a bare (rank, size) tuple is refused by name."""
    with pytest.raises(TypeError):
        World(1)  # type: ignore[call-arg]
    world = World(1, 2)
    with pytest.raises(AttributeError):
        world.rank = 0  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"world must be a lifeseq_shards.reader.World\(rank, size\)"):
        ShardedDataset(tmp_path, world=(1, 2))  # type: ignore[arg-type]
