"""Shared fixtures: composing configs exactly as `python -m tasks.sft` does, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tasks.compose import compose_config

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def compose_sft(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``configs/sft.yaml`` with overrides (the same schema validation as the CLI)."""
    return compose_config("sft", overrides)


def run_task_cli(task: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tasks.<task> ARGS`` in a real subprocess, offline, from ``cwd``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"tasks.{task}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_sft_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tasks.sft ARGS`` in a real subprocess, offline, from ``cwd``."""
    return run_task_cli("sft", args, cwd)


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    """A few-step CPU run in a temporary run dir, without progress bar."""
    return [
        f"run.dir={tmp_path / 'run'}",
        "run.device=cpu",
        "train.max_steps=4",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "scheduler.warmup_steps=1",
        "logging.progress=false",
        "export.hf=false",
    ]
