"""LoRA on the fused expert weights of MoE models (``lora.target_experts``).

transformers keeps a MoE block's experts as 3D parameters (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, each ``[E, out, in]``). An adapter gives every
expert its own low-rank update: ``W[e] + B[e] @ A[e] * scaling`` with ``A`` ``[E, r, in]``
(Kaiming-uniform, ``a = sqrt(5)``) and ``B`` ``[E, out, r]`` (zero) — PEFT's
``target_parameters`` LoRA, whose files store ``A`` as ``[E*r, in]`` and ``B`` as
``[out, r*E]`` (``peft_format.py`` converts).

The adapters live inside the experts module (its ``lora`` child, every tensor indexed by
expert first), so they go wherever the experts go: expert parallelism splits them over
``ep`` with their experts and FSDP shards them with the experts' own unit. The effective
weights are formed inside the experts' forward, after FSDP has gathered them.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from veoptim.lora.layer import AdapterSpec

#: The fused expert parameters an adapter can target.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
#: The child of a fused-experts module that holds its adapters.
ADAPTERS = "lora"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ExpertAdapters(nn.Module):
    """Per-expert adapters of one experts module: ``lora_A.<name>.<param>`` ``[E, r, in]``
    and ``lora_B.<name>.<param>`` ``[E, out, r]``."""

    def __init__(self, param_names: tuple[str, ...]) -> None:
        super().__init__()
        self.param_names = tuple(param_names)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.specs: dict[str, AdapterSpec] = {}
        self.active: tuple[str, ...] = ()

    def add(self, name: str, spec: AdapterSpec, experts: nn.Module) -> None:
        """New adapters for every targeted parameter of ``experts``, initialised like PEFT's."""
        a, b = nn.ParameterDict(), nn.ParameterDict()
        for param in self.param_names:
            weight = getattr(experts, param)
            num, out_features, in_features = weight.shape
            make = {"dtype": weight.dtype, "device": weight.device}
            a[param] = nn.Parameter(torch.empty(num, spec.r, in_features, **make))
            b[param] = nn.Parameter(torch.zeros(num, out_features, spec.r, **make))
            if not weight.is_meta:
                with torch.no_grad():  # PEFT initialises A as one [E*r, in] matrix
                    nn.init.kaiming_uniform_(a[param].view(-1, in_features), a=math.sqrt(5))
        self.lora_A[name], self.lora_B[name] = a, b
        self.specs[name] = spec
        self.active = (*self.active, name)

    def effective_weight(self, param: str, local: torch.Tensor, experts: range) -> torch.Tensor:
        """``local`` (the weights of ``experts``) plus every active adapter's update. Under
        expert parallelism the adapters are split like the weights (their local part is
        ``experts`` already); otherwise they hold every expert and are sliced."""
        if param not in self.param_names:
            return local
        weight = local
        for name in self.active:
            a, b = self.lora_A[name][param], self.lora_B[name][param]
            if isinstance(a, DTensor):  # split over ep with the experts: local part = experts
                a, b = a.to_local(), b.to_local()
            else:
                a, b = a[experts.start : experts.stop], b[experts.start : experts.stop]
            delta = torch.bmm(b.to(local.dtype), a.to(local.dtype)) * self.specs[name].scaling
            weight = weight + delta
        return weight


class LoRAExperts(nn.Module):
    """A fused-experts module (``base_layer``, frozen) that adds its ``lora`` child's updates."""

    def __init__(self, base_layer: nn.Module, param_names: tuple[str, ...]) -> None:
        super().__init__()
        base_layer.requires_grad_(False)
        base_layer.add_module(ADAPTERS, ExpertAdapters(param_names))
        self.base_layer = base_layer

    @property
    def adapters(self) -> ExpertAdapters:
        return getattr(self.base_layer, ADAPTERS)

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.adapters.param_names

    @property
    def specs(self) -> dict[str, AdapterSpec]:
        return self.adapters.specs

    def add_adapter(self, name: str, spec: AdapterSpec) -> None:
        self.adapters.add(name, spec, self.base_layer)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        base = self.base_layer
        if hasattr(base, "weight_transform"):  # expert parallel: applied after FSDP's gather
            base.weight_transform = self.adapters.effective_weight
            return base(*args, **kwargs)
        weights = {}
        for param in self.param_names:
            local = _local(getattr(base, param))
            weights[param] = self.adapters.effective_weight(param, local, range(local.shape[0]))
        return torch.func.functional_call(base, weights, args, kwargs)
