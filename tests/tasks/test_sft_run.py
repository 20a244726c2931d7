"""End-to-end SFT runs of the bundled tiny model on CPU, through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from callbacks.metrics import METRIC_KEYS
from tasks.runner import run_task
from tests.conftest import compose_sft, run_sft_cli
from veoptim.config import to_config
from veoptim.data import bundled_sample_path
from veoptim.distributed import init_distributed
from veoptim.trainer import Callback, Trainer

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_loss_falls(tmp_path):
    run_dir = tmp_path / "run"
    result = run_task(
        compose_sft(
            [
                f"run.dir={run_dir}",
                "run.device=cpu",
                "train.max_steps=40",
                "logging.progress=false",
                "export.hf=false",
            ]
        )
    )
    assert result["final_loss"] < 0.7 * result["first_loss"], result
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 41))


def test_metrics_jsonl_schema_and_resolved_config(tiny_overrides, tmp_path):
    run_task(compose_sft(tiny_overrides + ["logging.log_every=2"]))
    run_dir = tmp_path / "run"
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert set(METRIC_KEYS) <= set(record)
        assert all(isinstance(record[k], (int, float)) for k in METRIC_KEYS)
        assert record["loss"] > 0 and record["tokens_per_s"] > 0 and record["lr"] >= 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 4 and saved["run"]["dir"] == str(run_dir)


class HookRecorder(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            calls = object.__getattribute__(self, "calls")
            return lambda *args: calls.append(name)
        return object.__getattribute__(self, name)


def _trainer(overrides: list[str], callbacks=()) -> Trainer:
    cfg = to_config(compose_sft(overrides))
    ctx = init_distributed("cpu", "auto", {})
    return Trainer.from_config(cfg, ctx, list(callbacks))


def test_hooks_called_in_order_with_epochs(tiny_overrides):
    recorder = HookRecorder()
    small = f"data.train_path={bundled_sample_path()}"  # 8 examples: 2 steps per epoch
    trainer = _trainer(tiny_overrides + [small], [recorder])
    steps_per_epoch = trainer.sampler.steps_per_epoch
    trainer.cfg.train.max_steps = steps_per_epoch + 1
    trainer.train()
    calls = recorder.calls
    assert calls[0] == "on_train_begin" and calls[-1] == "on_train_end"
    assert calls.count("on_step_end") == steps_per_epoch + 1
    assert calls.count("on_epoch_begin") == 2 and calls.count("on_epoch_end") == 1
    assert trainer.sampler.epoch == 1


class MetricsRecorder(Callback):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.records.append(metrics)


def test_stop_at_step_stops_early_but_schedule_targets_max_steps(tiny_overrides):
    sliced, full = MetricsRecorder(), MetricsRecorder()
    trainer = _trainer(tiny_overrides + ["train.max_steps=10", "train.stop_at_step=3"], [sliced])
    assert trainer.train().global_step == 3
    _trainer(tiny_overrides + ["train.max_steps=10"], [full]).train()
    assert len(full.records) == 10
    # The sliced run is an exact prefix of the full run: same LR curve, same data, same losses.
    assert sliced.records[-1]["lr"] == full.records[2]["lr"]
    assert [r["loss"] for r in sliced.records] == [r["loss"] for r in full.records[:3]]


def _first_step_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients the optimizer sees at the first step (a spy around the real step)."""
    captured: dict[str, torch.Tensor] = {}
    real_step = trainer.optimizer.step

    def spy(*args, **kwargs):
        captured.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return real_step(*args, **kwargs)

    trainer.optimizer.step = spy
    trainer.train_step()
    return captured


def test_gradient_accumulation_matches_one_big_micro_batch(tiny_overrides):
    """Loss is normalised over the global batch, so accumulation does not change the gradient."""
    base = tiny_overrides + ["train.global_batch_size=8", "train.grad_clip=0"]
    one = _first_step_grads(_trainer(base + ["train.micro_batch_size=8"]))
    four = _first_step_grads(_trainer(base + ["train.micro_batch_size=2"]))
    assert one.keys() == four.keys()
    for name in one:
        torch.testing.assert_close(one[name], four[name], rtol=1e-4, atol=1e-7, msg=name)
    # Negative control: a mean of per-micro-batch means would be 4x these gradients.
    assert not torch.allclose(one["lm_head.weight"] * 4, four["lm_head.weight"], rtol=1e-2)


def test_multirun_sweep_writes_one_run_per_value_inside_run_dir(tmp_path):
    run_dir = tmp_path / "sweep"
    proc = run_sft_cli(
        [
            "-m",
            "optim.lr=1e-3,2e-3",
            f"run.dir={run_dir}",
            "run.device=cpu",
            "train.max_steps=2",
            "scheduler.warmup_steps=0",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "logging.progress=false",
            "export.hf=false",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = []
    for job in ("0", "1"):
        assert len(_metrics(run_dir / job)) == 2
        lrs.append(yaml.safe_load((run_dir / job / "config.yaml").read_text())["optim"]["lr"])
    assert lrs == [1e-3, 2e-3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"], "Hydra wrote outside run.dir"


def test_cli_bad_override_fails_with_one_clear_message(tmp_path):
    proc = run_sft_cli([f"run.dir={tmp_path / 'r'}", "train.micro_batch_size=3"], cwd=tmp_path)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "train.global_batch_size" in output and "Traceback" not in output


def test_wandb_offline_logs_inside_run_dir(tiny_overrides, tmp_path):
    run_task(compose_sft(tiny_overrides + ["logging.wandb.mode=offline"]))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_stop_at_step_saves_even_without_save_at_end(tiny_overrides, tmp_path):
    run_task(
        compose_sft(
            tiny_overrides
            + ["train.max_steps=4", "train.stop_at_step=2", "checkpoint.save_at_end=false"]
        )
    )
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_symlink()
    assert not (tmp_path / "run" / "checkpoints" / "step_00000004").exists()
