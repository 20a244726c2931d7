"""LoRA: adapters on a frozen base (layer, injection, checkpoint state, PEFT export)."""

from veoptim.lora.inject import apply_lora, lora_layers, target_names
from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear

__all__ = [
    "DEFAULT_ADAPTER",
    "AdapterSpec",
    "LoRALinear",
    "apply_lora",
    "lora_layers",
    "target_names",
]
