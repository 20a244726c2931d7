"""TensorBoard sink: event files read back with TensorBoard's own reader match metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.metrics import METRIC_KEYS, TENSORBOARD_DIR
from tasks.runner import run_task
from tests.conftest import compose_sft
from veoptim.config import to_config
from veoptim.errors import ConfigError


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_scalars_match_metrics_jsonl_and_continue_after_resume(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    tb = tiny_overrides + ["logging.tensorboard=true"]
    run_task(compose_sft(tb + ["train.stop_at_step=2"]))
    run_task(compose_sft(tb + ["checkpoint.resume=auto"]))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(run_dir / TENSORBOARD_DIR)
    assert len(list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2
    assert {f"train/{k}" for k in METRIC_KEYS if k != "step"} <= set(scalars)
    for key in ("loss", "lr", "grad_norm"):
        expected = [(r["step"], torch.tensor(r[key], dtype=torch.float32).item()) for r in records]
        assert sorted(scalars[f"train/{key}"]) == expected, key
    assert [step for step, _ in sorted(scalars["train/loss"])] == [1, 2, 3, 4]


def test_steps_logged_after_the_last_checkpoint_are_purged_on_resume(tiny_overrides, tmp_path):
    """A run that logged step 4 but saved only at step 3 (as after a crash) is resumed from
    3: step 4 is trained again and must appear once, with the new value."""
    tb = tiny_overrides + ["logging.tensorboard=true", "checkpoint.save_at_end=false"]
    run_task(compose_sft(tb + ["checkpoint.save_steps=3"]))
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").unlink()
    run_task(compose_sft(tb + ["checkpoint.resume=auto"]))
    scalars = _scalars(run_dir / TENSORBOARD_DIR)
    assert [step for step, _ in sorted(scalars["train/loss"])] == [1, 2, 3, 4]
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 4
    assert dict(scalars["train/grad_norm"])[4] == torch.tensor(record["grad_norm"]).float().item()


def test_disabled_by_default_writes_no_event_files(tiny_overrides, tmp_path):
    run_task(compose_sft(tiny_overrides))
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()


def test_missing_package_is_a_config_error_before_training(tiny_overrides, monkeypatch):
    # sys.modules[name] = None is how Python marks a package unavailable: import fails.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs the tensorboard"):
        to_config(compose_sft(tiny_overrides + ["logging.tensorboard=true"]))
