"""Multi-LoRA slots: concurrent adapters on one frozen base, each with its own optimizer,
checkpoints and exports (``SlotTrainer``; see ``docs/multi_lora.md``).

The config loads without torch (a task command checks its command line first); the
runtime names are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names
from veoptim.slots.config import MultiLoRAConfig

if TYPE_CHECKING:
    from veoptim.slots.trainer import SLOT_IDS, SlotLoss, SlotTrainer

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {"SLOT_IDS": "trainer", "SlotLoss": "trainer", "SlotTrainer": "trainer"}

__all__ = ["SLOT_IDS", "MultiLoRAConfig", "SlotLoss", "SlotTrainer"]

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
