"""Compose a task config from ``veoptim/configs/`` without the CLI (tests, benchmarks, notebooks)."""

from __future__ import annotations

import importlib
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import veoptim
from veoptim.config import TrainerConfig, to_config

#: The task configs ship inside the package, so an installed ``veoptim-sft`` finds them anywhere.
CONFIG_DIR = Path(veoptim.__file__).resolve().parent / "configs"


def compose_config(name: str = "sft", overrides: list[str] | None = None) -> DictConfig:
    """Compose ``veoptim/configs/<name>.yaml`` with overrides, validated against the schema like the CLI."""
    importlib.import_module(f"tasks.{name}")  # registers the task's schema
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


def load_config(name: str = "sft", overrides: list[str] | None = None) -> TrainerConfig:
    """``compose_config`` turned into the task's validated config dataclass."""
    return to_config(compose_config(name, overrides))
