"""LoRA on the fused expert weights of MoE models (``lora.target_experts``).

transformers keeps a MoE block's experts as 3D parameters (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, each ``[E, out, in]``). An adapter gives every
expert its own low-rank update: ``W[e] + B[e] @ A[e] * scaling`` with ``A`` ``[E, r, in]``
(Kaiming-uniform, ``a = sqrt(5)``) and ``B`` ``[E, out, r]`` (zero) — PEFT's
``target_parameters`` LoRA, whose files store ``A`` as ``[E*r, in]`` and ``B`` as
``[out, r*E]`` (``peft_format.py`` converts). The effective weights are formed inside the
experts' forward, after FSDP gathered them; under expert parallelism each rank uses the
slices of its own experts.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from veoptim.lora.layer import AdapterSpec

#: The fused expert parameters an adapter can target.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class LoRAExperts(nn.Module):
    """A fused-experts module (``base_layer``, frozen) plus per-expert adapters."""

    def __init__(self, base_layer: nn.Module, param_names: tuple[str, ...]) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.param_names = tuple(param_names)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.specs: dict[str, AdapterSpec] = {}
        self.active: tuple[str, ...] = ()
        base_layer.requires_grad_(False)

    def add_adapter(self, name: str, spec: AdapterSpec) -> None:
        """New per-expert adapters for every targeted parameter, initialised like PEFT's."""
        a, b = nn.ParameterDict(), nn.ParameterDict()
        for param in self.param_names:
            weight = getattr(self.base_layer, param)
            experts, out_features, in_features = weight.shape
            make = {"dtype": weight.dtype, "device": weight.device}
            a[param] = nn.Parameter(torch.empty(experts, spec.r, in_features, **make))
            b[param] = nn.Parameter(torch.zeros(experts, out_features, spec.r, **make))
            if not weight.is_meta:
                with torch.no_grad():  # PEFT initialises A as one [E*r, in] matrix
                    nn.init.kaiming_uniform_(a[param].view(-1, in_features), a=math.sqrt(5))
        self.lora_A[name], self.lora_B[name] = a, b
        self.specs[name] = spec
        self.active = (*self.active, name)

    def effective_weight(self, param: str, local: torch.Tensor, experts: range) -> torch.Tensor:
        """``local`` (the weights of ``experts``) plus every active adapter's update."""
        if param not in self.param_names:
            return local
        weight = local
        for name in self.active:
            a = self.lora_A[name][param][experts.start : experts.stop]
            b = self.lora_B[name][param][experts.start : experts.stop]
            delta = torch.bmm(b.to(local.dtype), a.to(local.dtype)) * self.specs[name].scaling
            weight = weight + delta
        return weight

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        base = self.base_layer
        if hasattr(base, "weight_transform"):  # expert parallel: applied after FSDP's gather
            base.weight_transform = self.effective_weight
            return base(*args, **kwargs)
        weights = {}
        for param in self.param_names:
            weight = getattr(base, param)
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            weights[param] = self.effective_weight(param, local, range(local.shape[0]))
        return torch.func.functional_call(base, weights, args, kwargs)

    def merged(self, param: str, name: str, full_weight: torch.Tensor) -> torch.Tensor:
        """``full_weight`` (all experts, FP32) with adapter ``name`` folded in."""
        a = self.lora_A[name][param].detach().float()
        b = self.lora_B[name][param].detach().float()
        return full_weight + torch.bmm(b, a) * self.specs[name].scaling
