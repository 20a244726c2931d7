"""LoRA: adapters on a frozen base (layer, injection, checkpoint state, PEFT export)."""

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


def __getattr__(name: str):  # noqa: ANN202 - module attribute hook
    """``veoptim.lora.SlotTrainer`` (and ``MultiLoRAConfig``), imported on first use: the
    slot runtime brings the optimizers and checkpointing, which adapters alone do not need."""
    if name in ("SlotTrainer", "MultiLoRAConfig", "SlotLoss"):
        from veoptim.lora import slots

        return getattr(slots, name)
    if name == "check_adapter_base":
        from veoptim.lora.peft_format import check_adapter_base

        return check_adapter_base
    raise AttributeError(f"module 'veoptim.lora' has no attribute {name!r}")
