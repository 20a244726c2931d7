"""``build_optimizer``: config -> param groups -> one of the four optimizer types.

Param groups: trainable parameters only; a parameter takes lr/weight decay from
the first ``optim.param_groups`` entry whose regex matches its name, and weight
decay 0 if any ``optim.no_decay_patterns`` regex matches; for
``cpu_offload_adamw`` a parameter is offloaded when any
``optim.cpu_offload_param_patterns`` regex matches. All regexes use
``re.search`` on the full parameter name. Parameters with equal settings share
a group, in the order of ``model.named_parameters()``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from veoptim.config.schema import OptimConfig
from veoptim.dtypes import resolve_dtype
from veoptim.errors import ConfigError
from veoptim.optim.exact_adamw import CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW
from veoptim.optim.state_keys import CPU_OFFLOAD
from veoptim.optim.torch_adamw import AdamW

SUPPORTED_OPTIMIZERS: tuple[str, ...] = (
    "adamw",
    "full_fp32_adamw",
    "master_fp32_adamw",
    "cpu_offload_adamw",
)
#: Moment dtype each fixed-precision type is defined by; another optim.moment_dtype is rejected.
_FIXED_MOMENTS = {"full_fp32_adamw": "fp32", "master_fp32_adamw": "bf16"}


def _compile(patterns: list[str], key: str) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ConfigError(f"{key} has an invalid regex {pattern!r}: {err}.") from err
    return compiled


@dataclass
class _Group:
    lr: float
    weight_decay: float
    offload: bool
    names: list[str] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)


def build_param_groups(
    model: torch.nn.Module, cfg: OptimConfig
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Torch param groups (with ``cpu_offload`` for the offload type) and id(param) -> name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("The model has no trainable parameters (every requires_grad is False).")
    no_decay = _compile(list(cfg.no_decay_patterns), "optim.no_decay_patterns")
    custom = [
        (g, _compile([g.pattern], "optim.param_groups[].pattern")[0]) for g in cfg.param_groups
    ]
    offload_res: list[re.Pattern[str]] = []
    if cfg.name == "cpu_offload_adamw":
        if not cfg.cpu_offload_param_patterns:
            raise ConfigError(
                "optim.cpu_offload_param_patterns is empty; cpu_offload_adamw needs at least one "
                "regex selecting the parameters to offload (e.g. ['mlp'])."
            )
        offload_res = _compile(
            list(cfg.cpu_offload_param_patterns), "optim.cpu_offload_param_patterns"
        )
    for pattern in [*(c for _, c in custom), *offload_res]:
        if not any(pattern.search(n) for n, _ in named):
            raise ConfigError(
                f"Optimizer pattern {pattern.pattern!r} matches no trainable parameter; "
                f"names look like {[n for n, _ in named[:3]]}."
            )
    groups: dict[tuple[float, float, bool], _Group] = {}
    for name, param in named:
        lr, wd = cfg.lr, cfg.weight_decay
        for group_cfg, pattern in custom:
            if pattern.search(name):
                lr = group_cfg.lr if group_cfg.lr >= 0 else cfg.lr
                wd = group_cfg.weight_decay if group_cfg.weight_decay >= 0 else cfg.weight_decay
                break
        if any(p.search(name) for p in no_decay):
            wd = 0.0
        offload = any(p.search(name) for p in offload_res)
        group = groups.setdefault((lr, wd, offload), _Group(lr, wd, offload))
        group.names.append(name)
        group.params.append(param)
    out = []
    for g in groups.values():
        entry: dict[str, Any] = {"params": g.params, "lr": g.lr, "weight_decay": g.weight_decay}
        if cfg.name == "cpu_offload_adamw":
            entry[CPU_OFFLOAD] = g.offload
        out.append(entry)
    names = {id(p): n for g in groups.values() for n, p in zip(g.names, g.params, strict=True)}
    return out, names


def _validate(cfg: OptimConfig) -> tuple[float, float]:
    if cfg.name not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(
            f"Unsupported optimizer type optim.name={cfg.name!r}; supported: "
            f"{', '.join(SUPPORTED_OPTIMIZERS)}."
        )
    if len(cfg.betas) != 2:
        raise ConfigError(f"optim.betas must have two values, got {list(cfg.betas)}.")
    required = _FIXED_MOMENTS.get(cfg.name)
    if required is not None and cfg.moment_dtype != required:
        raise ConfigError(
            f"{cfg.name} keeps {required} moments by definition, but optim.moment_dtype="
            f"{cfg.moment_dtype!r}; select optim={'full_fp32_adamw' if cfg.moment_dtype == 'fp32' else 'master_fp32_adamw'} "
            f"or set optim.moment_dtype={required}."
        )
    return float(cfg.betas[0]), float(cfg.betas[1])


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer selected by ``cfg.name`` over the model's trainable parameters."""
    betas = _validate(cfg)
    groups, names = build_param_groups(model, cfg)
    common: dict[str, Any] = dict(
        lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, param_names=names
    )
    if cfg.name == "adamw":
        return AdamW(groups, fused=cfg.fused and _fused_supported(groups), **common)
    exact: dict[str, Any] = dict(
        stochastic_rounding=cfg.stochastic_rounding,
        sr_seed=cfg.sr_seed,
        chunk_size=cfg.chunk_size,
        **common,
    )
    if cfg.name == "full_fp32_adamw":
        return FullFP32AdamW(groups, **exact)
    if cfg.name == "master_fp32_adamw":
        return MasterFP32AdamW(groups, **exact)
    return CPUOffloadAdamW(
        groups,
        resident_moment_dtype=resolve_dtype(
            cfg.resident_moment_dtype, "optim.resident_moment_dtype"
        ),
        offload_moment_dtype=resolve_dtype(cfg.cpu_moment_dtype, "optim.cpu_moment_dtype"),
        **exact,
    )


def _fused_supported(groups: list[dict[str, Any]]) -> bool:
    """torch's fused AdamW runs on CPU, CUDA, MPS and XPU for floating parameters."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    return all(
        p.device.type in supported and torch.is_floating_point(p)
        for g in groups
        for p in g["params"]
    )
