"""LoRA: adapters on a frozen base (layer, injection, checkpoint state, PEFT format).

The multi-LoRA runtime is a package of its own, ``veoptim.slots`` (``SlotTrainer``,
``MultiLoRAConfig``), built on these adapters: importing them does not import it, nor the
optimizers it brings. The names below are imported on first use (PEP 562): importing the
package loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names

if TYPE_CHECKING:
    from veoptim.lora.experts import LoRAExperts
    from veoptim.lora.inject import (
        adapters_disabled,
        apply_lora,
        lora_experts,
        lora_layers,
        target_names,
    )
    from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "LoRAExperts": "experts",
    "adapters_disabled": "inject",
    "apply_lora": "inject",
    "lora_experts": "inject",
    "lora_layers": "inject",
    "target_names": "inject",
    "DEFAULT_ADAPTER": "layer",
    "AdapterSpec": "layer",
    "LoRALinear": "layer",
}

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

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
