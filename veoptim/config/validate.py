"""Semantic checks that types alone cannot express; each error names the config key."""

from __future__ import annotations

import importlib.util

from veoptim.config.schema import TrainerConfig
from veoptim.dtypes import DTYPES
from veoptim.errors import ConfigError

CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("auto", "cpu", "cuda", "npu"),
    "model.dtype": tuple(DTYPES),
    "model.arch": ("qwen2", "qwen2_moe", "qwen3_moe"),
    "scheduler.name": ("constant", "linear", "cosine", "wsd"),
    "parallel.param_dtype": tuple(DTYPES),
    "parallel.reduce_dtype": tuple(DTYPES),
    "parallel.backend": ("auto", "gloo", "nccl", "hccl"),
    "checkpoint.hf_export.dtype": (*DTYPES, "preserve"),
    "logging.wandb.mode": ("disabled", "offline", "online"),
}

POSITIVE: tuple[str, ...] = (
    "train.max_steps",
    "train.global_batch_size",
    "train.micro_batch_size",
    "data.max_seq_len",
    "logging.log_every",
    "optim.chunk_size",
    "checkpoint.write_threads",
)

NON_NEGATIVE: tuple[str, ...] = (
    "train.stop_at_step",
    "train.grad_clip",
    "checkpoint.save_steps",
    "checkpoint.save_epochs",
    "checkpoint.keep_last",
    "scheduler.warmup_steps",
    "optim.lr",
    "optim.weight_decay",
)


def _get(cfg: TrainerConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate_config(cfg: TrainerConfig) -> None:
    """Raise ``ConfigError`` for the first invalid value (optimizer names are checked by the builder)."""
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}.")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}.")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)}.")
    train = cfg.train
    if train.stop_at_step > train.max_steps:
        raise ConfigError(
            f"train.stop_at_step ({train.stop_at_step}) must be <= train.max_steps ({train.max_steps})."
        )
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({train.micro_batch_size})."
        )
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas must be two values in [0, 1), got {list(cfg.optim.betas)}.")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # Checked here, on every rank, so no rank fails alone after the others started.
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package, which is not installed; "
            "install it with pip install -e '.[tensorboard]' or set logging.tensorboard=false."
        )
