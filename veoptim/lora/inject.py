"""Put adapters into a model: find the target Linear layers, wrap them, freeze the base."""

from __future__ import annotations

import re

import torch
from torch import nn

from veoptim.config.schema import LoRAConfig
from veoptim.errors import ConfigError
from veoptim.lora.layer import DEFAULT_ADAPTER, AdapterSpec, LoRALinear


def adapter_spec(cfg: LoRAConfig) -> AdapterSpec:
    return AdapterSpec(r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, use_rslora=cfg.use_rslora)


def is_target(name: str, cfg: LoRAConfig) -> bool:
    """PEFT's rule: a regex fullmatches the full name; a name matches itself or a suffix."""
    if cfg.target_regex:
        return re.fullmatch(cfg.target_regex, name) is not None
    return any(name == t or name.endswith("." + t) for t in cfg.target_modules)


def target_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Full names of the Linear layers the config selects (at least one, or ConfigError)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
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
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
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
    names = target_names(model, cfg)
    model.requires_grad_(False)
    spec = adapter_spec(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoRALinear(getattr(parent, child))
            layer.add_adapter(DEFAULT_ADAPTER, spec)
            setattr(parent, child, layer)
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{full name: layer}`` of every adapted layer (FSDP/EP wrappers keep the names)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
