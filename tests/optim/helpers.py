"""Shared pieces of the optimizer tests: tiny parameter sets, gradient streams, FP32 references."""

from __future__ import annotations

from collections.abc import Callable

import torch

from veoptim.optim import MASTER_WEIGHT

#: Shapes with odd sizes (vector tails), a 1-D norm-like vector and a 3-D tensor.
SHAPES = [(37, 29), (1024,), (1000,), (64,), (3, 5, 7)]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def initial_values(seed: int = 0) -> list[torch.Tensor]:
    """FP32 initial values that are exactly representable in BF16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).bfloat16().float() for s in SHAPES]


def grad_for(step: int, shape: tuple[int, ...], index: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic gradient whose scale varies over five decades with the step."""
    g = torch.Generator().manual_seed(1000 * step + index)
    scale = 10.0 ** -(step % 5)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(v.to(dtype)) for v in initial_values(seed)]


def set_grads(params: list[torch.nn.Parameter], step: int, dtype: torch.dtype) -> None:
    """The step's gradients (drawn on the CPU, so every device sees the same values), on
    each parameter's own device: a CUDA parameter refuses a CPU gradient."""
    for i, p in enumerate(params):
        p.grad = grad_for(step, tuple(p.shape), i, dtype).to(p.device)


def run_reference(
    steps: int, grad_dtype: torch.dtype, bf16_moments: bool = False, **hyper: object
) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """``torch.optim.AdamW`` in FP32 fed the same gradients (upcast exactly from ``grad_dtype``).

    With ``bf16_moments`` the reference stores its moments in BF16 after every step
    (round-to-nearest), which is the documented semantics of master_fp32_adamw.
    """
    params = make_params(torch.float32)
    opt = torch.optim.AdamW(params, fused=True, **{**HYPER, **hyper})
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grad_for(step, tuple(p.shape), i, grad_dtype).float()
        opt.step()
        if bf16_moments:
            for p in params:
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key].copy_(opt.state[p][key].bfloat16())
    return params, opt


def run_variant(
    factory: Callable[[list[dict]], torch.optim.Optimizer],
    steps: int,
    dtype: torch.dtype,
    offload_first: int = 0,
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Train ``make_params(dtype)`` for ``steps``; the first ``offload_first`` params are offloaded."""
    params = make_params(dtype)
    groups = [{"params": params[offload_first:]}] if offload_first < len(params) else []
    if offload_first:
        groups.insert(0, {"params": params[:offload_first], "cpu_offload": True})
    opt = factory(groups)
    for step in range(steps):
        set_grads(params, step, dtype)
        opt.step()
    return params, opt


def masters(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [opt.state[p][MASTER_WEIGHT] for p in params]
