"""LoRA: adapters on a frozen base (layer, injection, checkpoint state, PEFT format).

The multi-LoRA runtime is ``veoptim.lora.slots`` (``SlotTrainer``, ``MultiLoRAConfig``):
importing the adapters alone does not import it, nor the optimizers it brings.
"""

from veoptim.lora.experts import LoRAExperts
from veoptim.lora.inject import (
    adapters_disabled,
    apply_lora,
    lora_experts,
    lora_layers,
    target_names,
)
from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear

__all__ = [
    "DEFAULT_ADAPTER",
    "AdapterSpec",
    "LoRAExperts",
    "LoRALinear",
    "adapters_disabled",
    "apply_lora",
    "lora_experts",
    "lora_layers",
    "target_names",
]
