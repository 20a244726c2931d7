"""Compose a task config from ``configs/`` without the CLI (tests, benchmarks, notebooks)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from veoptim.config import register_configs

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose_config(name: str = "sft", overrides: list[str] | None = None) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with overrides, validated against the schema like the CLI."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])
