"""What a run checks and builds before its model exists, shared by ``Trainer.from_config``
and the dry run (``run.dry_run=true``), so that a dry run refuses exactly what the real
run would refuse, with the same words."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.config.launch import check_launch
from veoptim.config.schema import TrainerConfig
from veoptim.data import GlobalBatchSampler, load_tokenizer
from veoptim.data.holdout import Holdout, split_holdout
from veoptim.errors import ConfigError
from veoptim.models.build import check_model_fits
from veoptim.trainer.evaluation import EvalSet, build_eval_set
from veoptim.trainer.objective import Objective


@dataclass(frozen=True)
class RunInputs:
    """The tokenizer, the task's objective over its examples, and how they are split."""

    tokenizer: Any
    objective: Objective
    holdout: Holdout
    eval_set: EvalSet | None


def check_single_adapter(cfg: TrainerConfig, world_size: int) -> None:
    """A multi-rank config in one process, or multi-LoRA slots in this trainer: refused."""
    check_launch(cfg.parallel, world_size)
    if cfg.lora.num_slots:
        raise ConfigError(
            f"lora.num_slots={cfg.lora.num_slots} asks for multi-LoRA slots, which the "
            "multi-LoRA trainer runs (python -m tasks.multi_lora, "
            "veoptim.lora.slots.SlotTrainer); this task trains one adapter with "
            "lora.enabled=true and lora.num_slots=0."
        )


def load_inputs(cfg: TrainerConfig) -> RunInputs:
    """Tokenizer (checked against the model's size and the sequence length), the task's
    objective, the eval hold-out and the eval set."""
    tokenizer = load_tokenizer(
        cfg.data.tokenizer_path, model_path=cfg.model.path, chat_template=cfg.data.chat_template
    )
    check_model_fits(cfg.model, len(tokenizer), cfg.data.max_seq_len, tokenizer.name_or_path)
    objective = cfg.build_objective(tokenizer)
    holdout = split_holdout(objective.num_examples, cfg.data.eval_fraction)
    return RunInputs(
        tokenizer, objective, holdout, build_eval_set(cfg, tokenizer, objective, holdout)
    )


def build_sampler(
    cfg: TrainerConfig, inputs: RunInputs, *, dp_rank: int, dp_size: int
) -> GlobalBatchSampler:
    """The global-batch sampler over the training examples only (never the hold-out)."""
    holdout = inputs.holdout
    return GlobalBatchSampler(
        num_examples=len(holdout.train),
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=cfg.train.seed,
        data_fingerprint=holdout.fingerprint(inputs.objective.data_fingerprint),
        indices=holdout.train if holdout.eval else None,
    )


def run_length(cfg: TrainerConfig, sampler: GlobalBatchSampler) -> int:
    """The run's optimizer steps (``train.max_steps`` or ``train.epochs`` passes), with
    ``train.stop_at_step`` checked against it."""
    max_steps = cfg.train.total_steps(sampler.steps_per_epoch)
    if cfg.train.stop_at_step > max_steps:
        raise ConfigError(
            f"train.stop_at_step ({cfg.train.stop_at_step}) must be <= the run's {max_steps} "
            f"steps (train.epochs={cfg.train.epochs} x {sampler.steps_per_epoch} steps per epoch)."
        )
    return max_steps


def used_root_error(root: Path, newest: str) -> ConfigError:
    """A fresh run (``checkpoint.resume`` empty) in a root that holds another run's
    checkpoints: their names would be re-pointed and retention could delete them."""
    return ConfigError(
        f"{root} already holds checkpoints (newest: {newest}) and checkpoint.resume is "
        "empty; continue that run with checkpoint.resume=auto, use another run.dir (or "
        "checkpoint.root), or pass checkpoint.overwrite=true to start over in it."
    )
