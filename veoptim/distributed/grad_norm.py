"""Gradient-norm clipping across FSDP and expert-parallel meshes.

Dense and expert gradients are DTensors on different meshes, which
``torch.nn.utils.clip_grad_norm_`` cannot combine; we reduce the norm of each
(mesh, placements) group to a plain scalar, then combine the groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _group_key(grad: torch.Tensor) -> object:
    if isinstance(grad, DTensor):
        return (grad.device_mesh, grad.placements)
    return ("local", grad.device)


def group_by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split tensors into groups that foreach ops can take together (same mesh and placements)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_group_key(t), []).append(t)
    return list(groups.values())


def _group_norm(group: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of one mesh group; FP16 gradients are normed in FP32 (their squares, and a
    loss-scaled norm itself, overflow FP16 while every element is finite)."""
    if any(g.dtype == torch.float16 for g in group):
        norms = torch._foreach_norm(group, norm_type, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    return torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False, foreach=None)


def total_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all ``grads`` together, as a plain FP32 scalar identical on every rank."""
    if not grads:
        return torch.tensor(0.0)
    norms = []
    for group in group_by_mesh(grads):
        norm = _group_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, scale: float = 1.0
) -> torch.Tensor:
    """Scale gradients so their total norm is at most ``max_norm`` (0 or inf: no clipping);
    return the norm before clipping.

    ``scale`` first multiplies the gradients (e.g. ``1 / tokens`` turning accumulated loss
    sums into a mean), folded into the clip's multiply: one pass over the gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, norm_type) * scale
    if 0 < max_norm < math.inf:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) * scale
    elif scale != 1.0:
        coef = torch.tensor(scale)
    else:
        return total
    for group in group_by_mesh(grads):
        torch._foreach_mul_(group, coef.to(group[0].device))
    return total
