"""Objectives: a task's data and loss, plugged into the task-agnostic trainer loop.

The tasks' config schemas (``veoptim.objectives.schema``) import no torch, so a task
command checks its command line before loading anything heavy. The objectives and
losses below are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names
from veoptim.objectives.schema import DPOConfig, SFTConfig, SFTDataConfig

if TYPE_CHECKING:
    from veoptim.objectives.dpo import DPOObjective, preference_loss
    from veoptim.objectives.sft import SFTObjective, summed_token_loss

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DPOObjective": "dpo",
    "preference_loss": "dpo",
    "SFTObjective": "sft",
    "summed_token_loss": "sft",
}

__all__ = [
    "DPOConfig",
    "DPOObjective",
    "SFTConfig",
    "SFTDataConfig",
    "SFTObjective",
    "preference_loss",
    "summed_token_loss",
]

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
