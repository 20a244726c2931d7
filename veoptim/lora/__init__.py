"""LoRA: adapters on a frozen base (layer, injection, checkpoint state, PEFT export)."""

from veoptim.lora.experts import LoRAExperts
from veoptim.lora.inject import apply_lora, lora_experts, lora_layers, target_names
from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear

__all__ = [
    "DEFAULT_ADAPTER",
    "AdapterSpec",
    "LoRAExperts",
    "LoRALinear",
    "apply_lora",
    "lora_experts",
    "lora_layers",
    "target_names",
]
