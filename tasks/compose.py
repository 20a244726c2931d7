"""Compose a task config from ``configs/`` without the CLI (tests, benchmarks, notebooks)."""

from __future__ import annotations

import importlib
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import veoptim
from veoptim.config import TrainerConfig, prefer_explicit, to_config


def _config_dir() -> Path:
    """The Hydra configs: ``veoptim/configs`` in an installed package (setup.py maps the
    checkout's top-level ``configs/`` there at build time, so ``veoptim-sft`` finds them
    anywhere), else the checkout's ``configs/`` beside the ``veoptim`` package."""
    package = Path(veoptim.__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()


def compose_config(name: str = "sft", overrides: list[str] | None = None) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with overrides, validated against the schema like
    the CLI (a key the overrides give replaces its presets' alternative, as on the CLI)."""
    importlib.import_module(f"{__package__}.{name}")  # registers the task's schema
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides or [])
    prefer_explicit(cfg, overrides or [])  # e.g. a warmup_ratio replaces the preset's steps
    return cfg


def load_config(
    name: str = "sft", overrides: list[str] | None = None, *, resolve_model: bool = True
) -> TrainerConfig:
    """``compose_config`` turned into the task's validated config dataclass (``to_config``)."""
    return to_config(compose_config(name, overrides), resolve_model=resolve_model)
