"""Objectives: a task's data and loss, plugged into the task-agnostic trainer loop."""

from veoptim.objectives.sft import SFTConfig, SFTDataConfig, SFTObjective, summed_token_loss

__all__ = ["SFTConfig", "SFTDataConfig", "SFTObjective", "summed_token_loss"]
