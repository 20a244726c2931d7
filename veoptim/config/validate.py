"""Semantic checks that types alone cannot express; each error names the config key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    "export.dtype": (*DTYPES, "preserve"),
    "logging.wandb.mode": ("disabled", "offline", "online"),
}

#: The file that marks a veoptim training checkpoint (``veoptim.checkpoint.contents``,
#: which this package may not import).
TRAINING_CHECKPOINT_FILE = "checkpoint.json"

#: Model presets that load ``model.path`` (``veoptim/configs/model/<name>.yaml``); the path is required.
PATH_PRESETS: tuple[str, ...] = ("hf_local",)

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
    "lora.num_slots",
    "export.every_steps",
    "export.max_shard_size_mb",
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
    if not 0.0 <= cfg.model.attention_dropout < 1.0:
        raise ConfigError(
            f"model.attention_dropout must be in [0, 1), got {cfg.model.attention_dropout}."
        )
    _validate_model(cfg)
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # Checked here, on every rank, so no rank fails alone after the others started.
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package, which is not installed; "
            "install it with pip install -e '.[tensorboard]' or set logging.tensorboard=false."
        )


def _validate_model(cfg: TrainerConfig) -> None:
    """The model source and the sequence length it supports (a model.path is checked on load)."""
    model = cfg.model
    if model.name in PATH_PRESETS and not model.path:
        # hf_local.yaml cannot mark the path mandatory: merged over the schema's '' default,
        # '???' leaves '' in place, and the run would train the random bundled model.
        raise ConfigError(
            f"model.path is required with model={model.name} (a local Hugging Face model "
            "directory with config.json), but it is empty; add model.path=/path/to/model."
        )
    if model.path and (Path(model.path) / TRAINING_CHECKPOINT_FILE).is_file():
        raise ConfigError(
            f"model.path={model.path} is a veoptim training checkpoint, not a Hugging Face "
            "model directory; export it first (veoptim-export "
            f"{model.path} --out <dir> --name <name>) and pass model.path=<dir>/<name>."
        )
    if not model.path and cfg.data.max_seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"data.max_seq_len ({cfg.data.max_seq_len}) must be <= "
            f"model.max_position_embeddings ({model.max_position_embeddings}), the longest "
            "position the model supports; lower data.max_seq_len or raise "
            "model.max_position_embeddings."
        )
