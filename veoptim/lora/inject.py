"""Put adapters into a model: find the target Linear layers, wrap them, freeze the base."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

from veoptim.config.schema import LoRAConfig
from veoptim.errors import ConfigError
from veoptim.lora.experts import EXPERT_PARAMS, LoRAExperts
from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear
from veoptim.models.experts import is_fused_experts
from veoptim.models.quant import NF4Linear

#: What an adapter can wrap: a Linear layer, or one whose weight is 4-bit (model.quant=nf4).
LINEAR_TYPES = (nn.Linear, NF4Linear)


def adapter_spec(cfg: LoRAConfig) -> AdapterSpec:
    return AdapterSpec(r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, use_rslora=cfg.use_rslora)


def is_target(name: str, cfg: LoRAConfig) -> bool:
    """PEFT's rule: a regex fullmatches the full name; a name matches itself or a suffix."""
    if cfg.target_regex:
        return re.fullmatch(cfg.target_regex, name) is not None
    return any(name == t or name.endswith("." + t) for t in cfg.target_modules)


def expert_targets(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Full names of the fused-experts modules ``lora.target_experts`` adapts (ConfigError
    for an unknown parameter name, dropout, or a model without fused experts)."""
    if not cfg.target_experts:
        return []
    unknown = sorted(set(cfg.target_experts) - set(EXPERT_PARAMS))
    if unknown:
        raise ConfigError(
            f"lora.target_experts may name {list(EXPERT_PARAMS)}, got {list(cfg.target_experts)}."
        )
    if cfg.dropout:
        raise ConfigError(
            f"lora.target_experts needs lora.dropout=0 (expert adapters have no dropout), got "
            f"{cfg.dropout}."
        )
    names = [name for name, module in model.named_modules() if is_fused_experts(module)]
    if not names:
        raise ConfigError(
            "lora.target_experts is set but the model has no fused MoE experts "
            "(use a MoE model such as model=tiny_moe, or leave lora.target_experts empty)."
        )
    return names


def target_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Full names of the Linear layers the config selects (at least one, or ConfigError)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, LINEAR_TYPES)
        and not isinstance(module, LoRALinear)
        and is_target(name, cfg)
    ]
    if not names:
        what = (
            f"lora.target_regex={cfg.target_regex!r}"
            if cfg.target_regex
            else (f"lora.target_modules={list(cfg.target_modules)}")
        )
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LINEAR_TYPES)}
        )
        raise ConfigError(
            f"{what} selects no Linear layer of the model; its Linear layers are named {linear}."
        )
    return names


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Freeze every parameter of ``model``, wrap the targets in :class:`LoRALinear` with one
    ``default`` adapter (initialised from ``seed``, independent of the global RNG) and return
    the wrapped names. The model's parameter names of the base stay reachable under
    ``<name>.base_layer``."""
    if cfg.r <= 0 or cfg.alpha <= 0 or not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(
            f"lora.r and lora.alpha must be > 0 and lora.dropout in [0, 1), got r={cfg.r}, "
            f"alpha={cfg.alpha}, dropout={cfg.dropout}."
        )
    experts = expert_targets(model, cfg)
    names = (
        target_names(model, cfg) if cfg.target_modules or cfg.target_regex or not experts else []
    )
    model.requires_grad_(False)
    spec = adapter_spec(cfg)
    params = tuple(p for p in EXPERT_PARAMS if p in cfg.target_experts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in [*names, *experts]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            base = getattr(parent, child)
            layer = LoRAExperts(base, params) if name in experts else LoRALinear(base)
            layer.add_adapter(DEFAULT_ADAPTER, spec)
            setattr(parent, child, layer)
    return [*names, *experts]


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{full name: layer}`` of every adapted Linear (FSDP/EP wrappers keep the names)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_experts(model: nn.Module) -> dict[str, LoRAExperts]:
    """``{full name: module}`` of every adapted fused-experts module."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAExperts)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its frozen base: every adapter (Linear and expert) inactive inside
    the block, restored after it. The base needs no second copy (DPO's reference)."""
    layers: list[nn.Module] = [*lora_layers(model).values()]
    layers += [experts.adapters for experts in lora_experts(model).values()]
    saved = [layer.active for layer in layers]
    for layer in layers:
        layer.active = ()
    try:
        yield model
    finally:
        for layer, active in zip(layers, saved, strict=True):
            layer.active = active
