"""The config of a multi-LoRA (slot) trainer: the shared sections plus ``slots`` and the
demo's ``data.tasks``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from veoptim.config.schema import DataConfig, TrainerConfig, opt
from veoptim.dtypes import LOSS_SCALED_DTYPE
from veoptim.errors import ConfigError


@dataclass
class SlotsConfig:
    keep_last: int = opt(
        0, "Keep the newest N saves of each slot checkpoint name (0 = all); counted per name."
    )
    seed: int = opt(0, "Adapter initialisation seed of slot s is seed + s (create_slot(seed=...)).")


@dataclass
class MultiLoRADataConfig(DataConfig):
    train_path: str = opt("", "SFT JSONL file the demo draws from; empty = the bundled data.")
    tasks: list[str] = opt(
        ["Uppercase", "Reverse", "What is"],
        "tasks.multi_lora demo: one slot per task; a task is the prefix of the user prompts "
        "its slot trains on.",
    )


@dataclass
class MultiLoRAConfig(TrainerConfig):
    """Root config of ``python -m tasks.multi_lora`` and of ``SlotTrainer.from_config``."""

    data: MultiLoRADataConfig = field(default_factory=MultiLoRADataConfig)
    slots: SlotsConfig = field(default_factory=SlotsConfig)

    def build_objective(self, tokenizer: Any) -> Any:
        raise ConfigError(
            "a multi-LoRA config drives SlotTrainer (python -m tasks.multi_lora), not the "
            "single-model Trainer."
        )

    def check_task_keys(self) -> None:
        self.check_slot_keys()

    def check_slot_keys(self) -> None:
        """Refuse the shared keys a slot trainer has no use for, instead of ignoring them:
        slots are stepped by their callers, not over a dataset's epochs or eval split; and
        fp16, whose loss scaler is the single-model trainer's."""
        unused = {
            "train.epochs": self.train.epochs,
            "train.eval_every": self.train.eval_every,
            "data.eval_path": self.data.eval_path,
            "data.eval_fraction": self.data.eval_fraction,
        }
        if LOSS_SCALED_DTYPE in (self.model.dtype, self.parallel.param_dtype):
            raise ConfigError(
                f"multi-LoRA slots (tasks.multi_lora, veoptim-serve) do not train in fp16 (each "
                f"slot would need a loss scaler of its own), but model.dtype={self.model.dtype} "
                f"and parallel.param_dtype={self.parallel.param_dtype}; use bf16 or fp32."
            )
        set_keys = [f"{k}={v!r}" for k, v in unused.items() if v]
        if set_keys:
            raise ConfigError(
                "a multi-LoRA (slot) trainer has no dataset epochs or evaluation of its own; "
                f"leave these keys unset: {', '.join(set_keys)} (each slot's schedule length "
                "is train.max_steps)."
            )

    @property
    def schedule_steps(self) -> int:
        """The length every slot's LR schedule targets."""
        return self.train.total_steps(steps_per_epoch=0)
