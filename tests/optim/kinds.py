"""The three optimizer classes under test, built the same way from param groups."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from veoptim.optim import AdamW, CPUOffloadAdamW, ExactAdamW

#: torch's AdamW with veoptim loading; FP32 masters on the device; FP32 masters on the host.
KINDS = ("adamw", "exact", "offload")
DTYPES = (torch.float32, torch.bfloat16)


def make_opt(kind: str, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """``params``: tensors or param-group dicts; ``offload`` puts every group on the host."""
    items = list(params)
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    if kind == "adamw":
        return AdamW(groups, fused=True, **kwargs)
    if kind == "exact":
        return ExactAdamW(groups, **kwargs)
    assert kind == "offload", kind
    kwargs.setdefault("chunk_size", 128)
    return CPUOffloadAdamW([{**g, "cpu_offload": True} for g in groups], **kwargs)


def linear(dtype: torch.dtype, seed: int = 0, n_in: int = 33, n_out: int = 17) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out).to(dtype)


def batch(seed: int, dtype: torch.dtype, n_in: int = 33) -> torch.Tensor:
    return torch.randn(4, n_in, generator=torch.Generator().manual_seed(seed)).to(dtype)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    dtype = next(model.parameters()).dtype
    for s in steps:
        opt.zero_grad()
        loss_of(model, batch(s, dtype)).backward()
        opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, then every state tensor of every parameter (sorted keys), detached clones."""
    params = list(model.parameters())
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [opt.state[p][k].detach().clone() for k in sorted(opt.state[p])]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )
