"""Unsigned columns cross to torch bit for bit on every supported torch (before 2.3, which has no uint16 tensors, as
their signed view, read back on the device), in both layouts; what a torch lacks is detected, not assumed."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from ddp_harness import SPAWN_S, launch_log

from lifeseq_shards import compat
from lifeseq_shards.device.build import BatchBuilder
from lifeseq_shards.reader import BatchSpec, collate
from lifeseq_shards.store.format import Block, make_schema


def edge_block(token_dtype: str) -> tuple[Block, list[list[int]]]:
    """Two persons whose tokens sit at the edges of ``token_dtype`` (the top half reads negative if misread as
    signed), each token a run of its own, abspos negative too."""
    top = int(np.iinfo(token_dtype).max)
    people = [[0, top // 2, top // 2 + 1], [top, 1]]
    n = np.array([len(p) for p in people], dtype=np.uint16)
    tokens = np.concatenate([np.array(p, dtype=token_dtype) for p in people])
    runs = len(tokens)
    return Block({"person_id": np.array([7, 8], dtype=np.int64), "length": n, "n_runs": n.copy(), "tokens": tokens,
                  "run_length": np.ones(runs, dtype=np.uint16), "abspos": np.arange(runs, dtype=np.int16) - 300,
                  "age": np.full(runs, 255, dtype=np.uint8), "segment": np.full(runs, 2, dtype=np.uint8)}), people


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("packed", [False, True])
def test_unsigned_tokens_reach_the_model_batch_bit_for_bit(token_dtype: str, packed: bool) -> None:
    block, people = edge_block(token_dtype)
    host = collate(block, BatchSpec(make_schema(token_dtype), packed=packed))
    out = BatchBuilder(layout="packed" if packed else "padded")(host, "cpu", 0)
    ids = out["original_sequence"]
    got = ids.tolist() if packed else [row[: len(p)] for row, p in zip(ids.tolist(), people, strict=True)]
    assert (got == [t for p in people for t in p]) if packed else (got == people)
    abspos = out["input_ids"][1] if packed else out["input_ids"][:, 1][out["padding_mask"].bool()]
    assert abspos.tolist() == list(range(-300, -295))


def test_signed_views_only_where_torch_lacks_the_dtype() -> None:
    """The host tensor of a uint16 array: itself where torch has uint16, else its int16 view, the same bytes."""
    values = np.array([0, 32767, 32768, 65535], dtype=np.uint16)
    tensor = compat.to_tensor(values)
    assert tensor.numpy().tobytes() == values.tobytes()
    assert compat.unsigned_tensors() == hasattr(torch, "uint16")
    if compat.unsigned_tensors():
        assert tensor.dtype == torch.uint16 and not compat.is_view("uint16")
    else:
        assert tensor.dtype == torch.int16 and compat.is_view("uint16")
        assert compat.unsigned(tensor).tolist() == values.tolist()
    assert not compat.is_view("int16") and not compat.is_view("uint8")


def test_a_fallback_that_costs_is_said_once_a_run_by_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank takes the same fallback: rank 0 names it, once; another rank (torchrun's RANK, srun's
    SLURM_PROCID) says nothing."""
    for env, said in (({"RANK": "1"}, 0), ({"SLURM_PROCID": "3"}, 0), ({"RANK": "0"}, 1), ({}, 1)):
        for name in ("RANK", "SLURM_PROCID"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        compat.fallback.cache_clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compat.fallback("a kernel", "a slower one")
            compat.fallback("a kernel", "a slower one")
        notices = [w for w in caught if issubclass(w.category, compat.FallbackNotice)]
        assert len(notices) == said, (env, [str(w.message) for w in notices])
    compat.fallback.cache_clear()


@pytest.mark.slow
@pytest.mark.timeout(2 * SPAWN_S + 60)
def test_a_two_rank_fit_with_workers_names_no_fallback_more_than_once(lightning_spawn: Path,
                                                                      lightning_spawn_resumed: Path) -> None:
    """Their stack (torch 2.1.2: no uint16 tensors, no add_safe_globals; Lightning 2.2.2: no restart stages) loses
    nothing by its fallbacks: a 2-rank pytorch_lightning fit with 2 workers a rank (spawned, started again each
    epoch), resumed from a mid-epoch checkpoint, prints no FallbackNotice more than once (before: one per process and
    worker, 20 in a fit). The newest stack takes none. The fit and its resume are tests/conftest.py's, which
    tests/reader/test_ddp.py checks the batches of."""
    out = launch_log(lightning_spawn) + launch_log(lightning_spawn_resumed)
    notices = re.findall(r"FallbackNotice: (.*)", out)
    assert len(notices) == len(set(notices)) <= 1, notices
