"""Objectives: a task's data and loss, plugged into the task-agnostic trainer loop."""

from veoptim.objectives.dpo import DPOConfig, DPOObjective, preference_loss
from veoptim.objectives.sft import SFTConfig, SFTDataConfig, SFTObjective, summed_token_loss

__all__ = [
    "DPOConfig",
    "DPOObjective",
    "SFTConfig",
    "SFTDataConfig",
    "SFTObjective",
    "preference_loss",
    "summed_token_loss",
]
