"""Semantic checks that types alone cannot express; each error names the config key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from veoptim.arith import is_power_of_two
from veoptim.config.schema import DEFAULT_MAX_STEPS, TrainerConfig
from veoptim.dtypes import DTYPE_NAMES, LOSS_SCALED_DTYPE, WIDE_RANGE_DTYPE_NAMES
from veoptim.errors import ConfigError

CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("auto", "cpu", "cuda", "npu"),
    "model.dtype": tuple(DTYPE_NAMES),
    "model.arch": ("qwen2", "qwen2_moe", "qwen3_moe"),
    "model.quant": ("none", "nf4"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "sdpa_varlen"),
    "scheduler.name": ("constant", "linear", "cosine", "wsd"),
    "parallel.param_dtype": tuple(DTYPE_NAMES),
    "parallel.reduce_dtype": WIDE_RANGE_DTYPE_NAMES,
    "parallel.backend": ("auto", "gloo", "nccl", "hccl"),
    "export.dtype": (*DTYPE_NAMES, "preserve"),
    "logging.wandb.mode": ("disabled", "offline", "online"),
}

#: The file that marks a veoptim training checkpoint (``veoptim.checkpoint.component``,
#: which this package may not import).
TRAINING_CHECKPOINT_FILE = "checkpoint.json"

#: Model presets that load ``model.path`` (``configs/model/<name>.yaml``); the path is required.
PATH_PRESETS: tuple[str, ...] = ("hf_local",)

POSITIVE: tuple[str, ...] = (
    "train.global_batch_size",
    "train.micro_batch_size",
    "data.max_seq_len",
    "logging.log_every",
    "optim.chunk_size",
    "checkpoint.write_threads",
    "train.loss_scale_growth_interval",
)

NON_NEGATIVE: tuple[str, ...] = (
    "train.max_steps",
    "train.epochs",
    "train.eval_every",
    "train.stop_at_step",
    "train.micro_batch_tokens",
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

#: What a negative value of these keys probably meant (``max_steps=-1`` is "train by epochs"
#: in the Hugging Face Trainer).
NEGATIVE_HINTS: dict[str, str] = {
    "train.max_steps": (
        "a negative value does not mean 'by epochs' here, as -1 does in the Hugging Face "
        "Trainer: for passes over the data set train.epochs=N "
        "(with train.max_steps=0, the default); train.max_steps=0 without train.epochs runs "
        f"{DEFAULT_MAX_STEPS} steps"
    ),
}


def _get(cfg: TrainerConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate_config(cfg: TrainerConfig) -> None:
    """Raise ``ConfigError`` for the first invalid value (optimizer names are checked by the builder)."""
    cfg.check_task_keys()
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}.")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}.")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            hint = f" ({NEGATIVE_HINTS[key]})" if key in NEGATIVE_HINTS else ""
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)}{hint}.")
    train = cfg.train
    _validate_length_and_eval(cfg)
    if not train.epochs and train.stop_at_step > train.total_steps(0):
        raise ConfigError(
            f"train.stop_at_step ({train.stop_at_step}) must be <= train.max_steps "
            f"({train.total_steps(0)})."
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
    _validate_fp16(cfg)
    if cfg.model.quant != "none" and not (cfg.lora.enabled or cfg.lora.num_slots):
        raise ConfigError(
            f"model.quant={cfg.model.quant} freezes the base in 4 bits, which only a LoRA run "
            "(or multi-LoRA slots) trains around; set lora.enabled=true (or model.quant=none)."
        )
    _validate_flash_attention(cfg)
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        # Checked here, on every rank, so no rank fails alone after the others started.
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package, which is not installed; "
            "install it with pip install -e '.[tensorboard]' or set logging.tensorboard=false."
        )


def _validate_length_and_eval(cfg: TrainerConfig) -> None:
    """One way to set the run length and the warmup, and evaluation only with eval data."""
    train, data, scheduler = cfg.train, cfg.data, cfg.scheduler
    if train.max_steps and train.epochs:
        raise ConfigError(
            f"train.max_steps ({train.max_steps}) and train.epochs ({train.epochs}) both set "
            "the run length; set only one (train.max_steps=0 to train by epochs)."
        )
    if not 0.0 <= scheduler.warmup_ratio < 1.0:
        raise ConfigError(
            f"scheduler.warmup_ratio must be in [0, 1), got {scheduler.warmup_ratio}."
        )
    if scheduler.warmup_ratio and scheduler.warmup_steps:
        raise ConfigError(
            f"scheduler.warmup_ratio ({scheduler.warmup_ratio}) and scheduler.warmup_steps "
            f"({scheduler.warmup_steps}) both set the warmup; give only one (either one alone "
            "on the command line replaces the other's preset value)."
        )
    if not 0.0 <= data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}.")
    if data.eval_fraction and data.eval_path:
        raise ConfigError(
            f"data.eval_path ({data.eval_path}) and data.eval_fraction ({data.eval_fraction}) "
            "both choose the evaluation data; set only one."
        )
    if train.eval_every and not (data.eval_path or data.eval_fraction):
        raise ConfigError(
            f"train.eval_every={train.eval_every} needs evaluation data, but data.eval_path "
            "and data.eval_fraction are unset; set one of them or train.eval_every=0."
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


#: The optimizers without FP32 masters (an fp16 run needs them).
NO_MASTER_OPTIMIZERS = ("adamw",)


def _validate_fp16(cfg: TrainerConfig) -> None:
    """fp16 compute is one setting of three keys: the model's dtype, FSDP2's compute dtype
    (so one and several ranks compute alike) and an optimizer with FP32 masters, which the
    loss scaler unscales into."""
    fp16, model, parallel = LOSS_SCALED_DTYPE, cfg.model.dtype, cfg.parallel.param_dtype
    if parallel == fp16 and model != fp16:
        raise ConfigError(
            f"parallel.param_dtype={fp16} computes in fp16, which is loss-scaled only for "
            f"model.dtype={fp16}, but model.dtype={model}; set model.dtype={fp16} or "
            "parallel.param_dtype=bf16."
        )
    if model != fp16:
        return
    if parallel == "bf16":
        raise ConfigError(
            f"model.dtype={fp16} trains in fp16, but parallel.param_dtype=bf16 would compute in "
            f"bf16 under FSDP2; set parallel.param_dtype={fp16} too."
        )
    if cfg.optim.name in NO_MASTER_OPTIMIZERS:
        raise ConfigError(
            f"model.dtype={fp16} keeps FP32 master weights, which optim={cfg.optim.name} has "
            "not; use optim=master_fp32_adamw, full_fp32_adamw or cpu_offload_adamw."
        )
    if not (is_power_of_two(cfg.train.loss_scale_init) and cfg.train.loss_scale_init >= 1):
        raise ConfigError(
            "train.loss_scale_init must be a power of two >= 1 (scaling by it is exact), got "
            f"{cfg.train.loss_scale_init!r}."
        )


def _validate_flash_attention(cfg: TrainerConfig) -> None:
    """flash_attention_2 needs the flash_attn package and CUDA (``run.device=auto`` is
    checked again once resolved, by the parallel plan)."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 needs the flash_attn package, which is "
            "not installed; install flash-attn or use model.attn_implementation=sdpa."
        )
    if cfg.run.device in ("cpu", "npu"):
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 runs only on CUDA, but run.device="
            f"{cfg.run.device}; use model.attn_implementation=sdpa."
        )
