"""The reference model learns and has tensor-core-friendly rounded sizes; the training sweep runs end to end on CPU
through the real DataModule and reports sane numbers (real tokens counted, not padding)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lifeseq_shards.convert.passes import ConvertOptions, convert_dataset
from lifeseq_shards.convert.sources.synth import synth_population
from lifeseq_shards.device.build import host_sync_guard
from lifeseq_shards.encoder import EncoderLayer
from lifeseq_shards.model import (
    SIZES,
    EncoderConfig,
    LifeSeqEncoder,
    LifeSeqPretrainModule,
    model_flops_per_token,
    pretrain_losses,
)
from lifeseq_shards.reader import ShardedDataset, ShardedLoader, World
from tools import common
from tools import train_bench as bench
from tools import varlen_tables as tables


def _layer_weights(cfg: EncoderConfig) -> int:
    """Matmul weights of one layer, counted on the module itself (not from the formula under test)."""
    return sum(p.numel() for p in EncoderLayer(cfg, 0.0).parameters() if p.ndim == 2)


@pytest.mark.parametrize("name", [n for n in SIZES if n.endswith("-tc")])
def test_rounded_sizes_are_tensor_core_friendly_and_close(name: str) -> None:
    cfg, orig = SIZES[name], SIZES[name.removesuffix("-tc")]
    assert cfg.hidden % 64 == 0 and cfg.ff % 64 == 0
    assert cfg.hidden % cfg.heads == 0 and cfg.head_dim % 8 == 0
    assert cfg.layers == orig.layers
    assert abs(_layer_weights(cfg) / _layer_weights(orig) - 1) < 0.02


def test_flops_per_token_is_six_times_the_layer_weights_plus_attention() -> None:
    cfg = SIZES["small"]
    weights = cfg.layers * _layer_weights(cfg)
    assert model_flops_per_token(cfg, 0) == 6 * weights
    # attention: QK^T and PV, 2 matmuls x 2 FLOPs x L x hidden per layer, x3 for the backward
    assert model_flops_per_token(cfg, 100) - model_flops_per_token(cfg, 0) == 3 * cfg.layers * 4 * 100 * cfg.hidden


def _fixed_batch(vocab: int, b: int = 8, n: int = 24, t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(n // 2, n + 1, (b,), generator=g)
    real = (torch.arange(n) < lengths[:, None]).long()
    ids = torch.stack([
        torch.randint(5, vocab, (b, n), generator=g), torch.randint(0, 16000, (b, n), generator=g),
        torch.randint(0, 90, (b, n), generator=g), torch.randint(1, 3, (b, n), generator=g),
    ], 1) * real[:, None]
    pos = torch.stack([torch.randperm(int(n // 2), generator=g)[:t] + 1 for _ in range(b)])
    return {"input_ids": ids, "padding_mask": real, "target_pos": pos, "target_tokens": ids[:, 0].gather(1, pos),
            "target_cls": torch.randint(0, 3, (b,), generator=g)}


def test_mlm_loss_decreases_on_a_fixed_batch() -> None:
    torch.manual_seed(0)
    vocab = 40
    model = LifeSeqEncoder(EncoderConfig(64, 128, 2, 4), vocab, dropout=0.0)
    batch = _fixed_batch(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        mlm, cls = pretrain_losses(model, batch)
        losses.append(mlm.item())
        opt.zero_grad()
        (mlm + cls).backward()
        opt.step()
    assert losses[-1] < 0.3 * losses[0]


def test_onecycle_is_sized_from_this_ranks_steps() -> None:
    """limit 6 batches x 2 epochs = 12 optimizer steps: the schedule must end exactly there."""
    vocab = 40
    module = LifeSeqPretrainModule(EncoderConfig(64, 128, 1, 1), vocab)
    loader = torch.utils.data.DataLoader([_fixed_batch(vocab)] * 20, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == 12
    assert trainer.global_step == 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    synth_population(root / "raw", 300, 0)
    out = root / "shards"
    convert_dataset([str(root / "raw" / "sequences.parquet")], out, vocab=str(root / "raw" / "vocab.csv"),
                    opts=ConvertOptions(progress=False))
    return out


@pytest.mark.slow
def test_tiny_sweep_end_to_end(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pre = bench.PRESETS["tiny"]
    points = pre.points()
    assert [(p.attention, p.prefetch, p.prefetch_thread) for p in points] == [
        ("padded", False, False), ("varlen", False, False), ("varlen", True, False), ("varlen", True, True)]
    rows = bench.run_sweep(points, shards, tmp_path, pre.steps, pre.warmup, pre.budget_s, seed=0, preset="tiny")
    assert [r["status"] for r in rows] == ["ok"] * 4, rows
    for name in ("results.csv", "results.md", "tokens_per_s.png", "data_wait_frac.png", "device_gap_frac.png"):
        assert (tmp_path / name).stat().st_size > 0
    with (tmp_path / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4
    for r, p in zip(table, points, strict=True):
        assert float(r["tokens_per_s"]) > 0 and float(r["samples_per_s"]) > 0 and float(r["step_time_s"]) > 0
        assert 0 <= float(r["data_wait_frac"]) <= 1
        # on CPU the device's timeline is the host's: its gaps between steps are the host's waits, pair for pair
        assert float(r["device_gap_frac"]) == pytest.approx(float(r["data_wait_frac"]), abs=0.01)
        assert 0 < float(r["mfu"]) < 1 and float(r["peak_mem_mb"]) > 0
        n = int(r["steps"])
        assert n == pre.steps - pre.warmup
        # the host's time per step, split by phase: on CPU (synchronous) the phases and the wait are the whole step
        phases = [float(r[f"host_{phase}_ms"]) for phase in bench.HOST_PHASES]
        step_ms = float(r["step_time_s"]) * 1e3
        assert all(ms > 0 for ms in phases)
        assert 0.8 * step_ms <= sum(phases) + float(r["data_wait_frac"]) * step_ms <= step_ms * 1.0001
        # The measured steps are batches warmup..steps-1 of epoch 0: replay them and sum their real lengths.
        # Read with the reader the DataModule wraps (rank 0 of 1, shuffled with the same seed, cropped to max_len).
        ds = ShardedDataset(shards, split="train", batch_size=p.batch_size, world=World(0, 1), seed=0, pad_to=p.max_len)
        seen = list(zip(range(pre.steps), ShardedLoader(ds), strict=False))
        lengths = torch.cat([b["lengths"] for _, b in seen[pre.warmup:]])
        assert int(r["real_tokens"]) == int(lengths.sum())
        if p.attention == "padded":
            assert int(r["padded_tokens"]) == len(lengths) * p.max_len > int(r["real_tokens"])
            assert int(r["padded_tokens"]) == n * p.batch_size * p.max_len
            assert float(r["mfu_slots"]) > float(r["mfu"])  # the padding's work counted
        else:  # padding-free: the slots computed are the real tokens
            assert int(r["padded_tokens"]) == int(r["real_tokens"]) and float(r["pad_frac"]) == 0
            assert float(r["mfu_slots"]) == pytest.approx(float(r["mfu"]))
    md = (tmp_path / "results.md").read_text()
    assert md.count("| small | 128 |") == 4
    phases = tables.main(tmp_path).split("### Host time per step, by phase (ms)")[1].strip().splitlines()
    assert len(phases) == 2 + 4 and phases[2].startswith("| small padded eager | ")  # header, rule, a row a point
    assert [float(c.replace(",", "")) for c in phases[2].split("|")[4:7]] == pytest.approx(
        [float(table[0][f"host_{phase}_ms"]) for phase in bench.HOST_PHASES], rel=0.01)

    # --resume after a stop: the ok rows come back exactly as measured, and only the other points run again.
    table[1]["status"] = "skipped"
    with (tmp_path / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, list(table[0]))
        w.writeheader()
        w.writerows(table)
    asked: list = []
    fake = {k: 1.0 for k in bench.RESULT_KEYS if k not in ("status", "reason")}
    monkeypatch.setattr(bench, "run_point", lambda p, *_a: asked.append(p) or fake)
    again = bench.run_sweep(points, shards, tmp_path, pre.steps, pre.warmup, pre.budget_s,
                            done=bench.read_csv(tmp_path / "results.csv"))
    assert asked == [points[1]]
    assert again[0] == rows[0] and again[1]["tokens_per_s"] == 1.0


def test_training_step_never_pulls_a_value_to_the_host() -> None:
    """Inside training_step (forward, loss, logging) no .item()/.tolist()/bool(tensor)... (device.host_sync_guard)."""
    vocab = 40
    module = LifeSeqPretrainModule(EncoderConfig(64, 128, 1, 1), vocab)
    inner = module.training_step

    def guarded(batch, batch_idx):
        with host_sync_guard():
            return inner(batch, batch_idx)

    module.training_step = guarded
    loader = torch.utils.data.DataLoader([_fixed_batch(vocab)] * 3, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_varlen_tables_judge_small_tc_at_its_fastest_point(tmp_path: Path) -> None:
    """The first run's results.csv (no masker / prefetch_thread columns) and a later one with them: the original bars
    read the default-lever points, the two extra rows the fastest padding-free small-tc point, gap and speed-up."""
    axes = ("size", "attention", "prefetch", "compile", "status", "tokens_per_s", "device_gap_frac")
    old = [("small-tc", "padded", "False", "False", "ok", "1000", "0.05"),
           ("small-tc", "varlen", "True", "False", "ok", "1150", "0.18"),
           ("small-tc", "varlen", "True", "True", "ok", "1360", "0.36")]
    new = [(*r, "eager", "False") for r in old] + [
        ("small-tc", "varlen", "True", "True", "ok", "1900", "0.03", "compiled", "True"),
        ("small-tc", "varlen", "True", "False", "skipped", "", "", "compiled", "False")]
    graphed = [*new, ("small-tc", "varlen", "True", "True", "ok", "2000", "0.02", "graphed", "False")]
    for rows, cols, best, gap, ratio in ((old, axes, "varlen prefetch compiled", "0.36", "1.36"),
                                         (new, (*axes, "masker", "prefetch_thread"),
                                          "varlen prefetch in a thread compiled + masker compiled", "0.03", "1.9"),
                                         (graphed, (*axes, "masker", "prefetch_thread"),
                                          "varlen prefetch compiled + masker graphed", "0.02", "2")):
        with (tmp_path / "results.csv").open("w", newline="") as f:  # the other columns blank
            out = csv.DictWriter(f, [*cols, *(k for k in tables.NUMBERS if k not in cols)], restval="")
            out.writeheader()
            out.writerows(dict(zip(cols, r, strict=True)) for r in rows)
        md = tables.main(tmp_path)
        assert "| small-tc varlen (prefetch) / padded eager, real tokens/s | 1.15 | >= 1.5x | NO |" in md
        assert f"| small-tc fastest padding-free point ({best}) device_gap_frac | {gap} | < 5 % |" in md
        assert f"| small-tc fastest padding-free point ({best}) / padded eager, real tokens/s | {ratio} |" in md


@pytest.mark.parametrize(("option", "value"), [("--masker", "fancy"), ("--attention", "flat"), ("--precisions", "fp8")])
def test_an_unknown_axis_value_is_refused_before_anything_runs(tmp_path: Path, option: str, value: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(bench.main, ["--preset", "tiny", "--out", str(tmp_path), option, value])
    assert result.exit_code == 2 and f"['{value}']" in result.output
    assert not any(tmp_path.iterdir())  # no data synthesised, no results written


def test_a_checkpoint_of_a_custom_size_loads_with_lightnings_defaults(tmp_path: Path) -> None:
    """hparams holding an EncoderConfig load under torch.load's weights_only mode (Lightning's default), not only
    with weights_only=False."""
    module = LifeSeqPretrainModule(EncoderConfig(64, 128, 1, 1), 40)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader([_fixed_batch(40)] * 2, batch_size=None))
    trainer.save_checkpoint(tmp_path / "custom.ckpt")
    again = LifeSeqPretrainModule.load_from_checkpoint(tmp_path / "custom.ckpt")
    assert again.cfg == module.cfg
    weights = zip(again.state_dict().values(), module.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)


def test_base_and_batch_presets_are_issue_24s_sweep(tmp_path: Path) -> None:
    """base: the researchers' BERT-base at 512 and 1,024 in every precision, padded and padding-free (prefetched);
    batch: small, medium and their -tc twins from batch 256 to 4,096; the base data synthesised at the 1,024 cap."""
    base = bench.PRESETS["base"].points()
    assert {(p.size, p.max_len, p.precision, p.attention, p.prefetch) for p in base} == {
        ("base", n, prec, attn, attn == "varlen") for n in (512, 1024) for prec in bench.PRECISIONS
        for attn in ("padded", "varlen")}
    assert base[0].max_len == 1024  # the length they train at, first
    batch = bench.PRESETS["batch"].points()
    for size in ("small", "medium", "small-tc", "medium-tc"):
        assert sorted({p.batch_size for p in batch if p.size == size}) == [256, 512, 1024, 2048, 4096]
    shards = common.synth_dataset(tmp_path, 30, 0, max_seq_len=bench.PRESETS["base"].max_seq_len)
    assert json.loads((shards / "manifest.json").read_text())["params"]["max_seq_len"] == 1024
