"""Multi-LoRA slots: concurrent adapters on one frozen base, each with its own optimizer,
checkpoints and exports (``SlotTrainer``; see ``docs/multi_lora.md``)."""

from veoptim.lora.slots.config import MultiLoRAConfig
from veoptim.lora.slots.trainer import SLOT_IDS, SlotLoss, SlotTrainer

__all__ = ["SLOT_IDS", "MultiLoRAConfig", "SlotLoss", "SlotTrainer"]
