"""A frozen ``nn.Linear`` plus named low-rank adapters, with PEFT's LoRA math.

``y = base(x) + lora_B(lora_A(dropout(x))) * scaling`` with ``scaling = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA), A initialised Kaiming-uniform (``a = sqrt(5)``) and
B zero, so a fresh adapter leaves the model unchanged. The module layout mirrors
PEFT's (``base_layer``, ``lora_A.<name>``, ``lora_B.<name>``, ``lora_dropout.<name>``),
so adapter keys map one-to-one onto a PEFT adapter file.

Adapters are kept by name, each with its own parameters: a single LoRA run has one
(``default``); a multi-tenant trainer gives the same layer one adapter per slot and
routes batch rows to them, without a second implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_ADAPTER = "default"


@dataclass(frozen=True)
class AdapterSpec:
    """Hyperparameters of one adapter."""

    r: int
    alpha: float
    dropout: float = 0.0
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class RowRouter(Protocol):
    """Routes batch rows to adapters (multi-LoRA slots: each row uses its slot's adapter)."""

    def add_deltas(
        self, layer: LoRALinear, x: torch.Tensor, result: torch.Tensor
    ) -> torch.Tensor: ...


class LoRALinear(nn.Module):
    """``base_layer`` (frozen: an ``nn.Linear``, or an ``NF4Linear`` of a 4-bit base) plus
    the adapters in ``lora_A`` / ``lora_B``."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.specs: dict[str, AdapterSpec] = {}
        self.active: tuple[str, ...] = ()
        #: Set by a multi-LoRA trainer: rows then go to their slot's adapter only.
        self.router: RowRouter | None = None
        base_layer.requires_grad_(False)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def base_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        """The dtype the base computes in and its device (what its adapters get)."""
        base = self.base_layer
        if isinstance(base, nn.Linear):
            return base.weight.dtype, base.weight.device
        return base.compute_dtype, base.nf4_codes.device  # a 4-bit base (models/quant.py)

    def add_adapter(self, name: str, spec: AdapterSpec) -> None:
        """A new adapter in the base weight's dtype and device, initialised like PEFT's."""
        dtype, device = self.base_dtype_device()
        make = {"dtype": dtype, "device": device, "bias": False}
        self.lora_A[name] = nn.Linear(self.in_features, spec.r, **make)
        self.lora_B[name] = nn.Linear(spec.r, self.out_features, **make)
        self.lora_dropout[name] = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.specs[name] = spec
        self.reset_adapter(name)
        self.active = (*self.active, name)

    def reset_adapter(self, name: str) -> None:
        """Fresh initialisation: A Kaiming-uniform (PEFT's ``a = sqrt(5)``), B zero."""
        if self.lora_A[name].weight.is_meta:
            return  # filled later from another rank's weights
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A[name].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[name].weight)

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution ``B(A(dropout(x))) * scaling``.

        An adapter allocated with more rows than its spec's rank (a multi-LoRA slot of
        a lower rank than the slots' maximum) uses its leading ``r`` rows of A and
        columns of B; the rest get zero gradients and stay zero.
        """
        spec = self.specs[name]
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        if spec.r < a.shape[0]:
            a, b = a[: spec.r], b[:, : spec.r]
        x = x.to(a.dtype)
        return F.linear(F.linear(self.lora_dropout[name](x), a), b) * spec.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.router is not None:
            return self.router.add_deltas(self, x, result)
        for name in self.active:
            result = result + self.delta(name, x).to(result.dtype)
        return result
