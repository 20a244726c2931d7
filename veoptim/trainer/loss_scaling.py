"""The update of an fp16 step: unscale, clip and step in one divide, or skip.

The backward ran on ``loss * scale`` (``veoptim/optim/loss_scale.py``). The gradients'
global norm, taken in FP32 over every rank, tells an overflow (inf or nan: not finite)
from a clean step. A clean step never touches the FP16 gradients: the clip coefficient
is folded into the divisor that the optimizer's kernel divides each gradient by once it
is FP32 (``ExactAdamW.step(grad_divisor=...)``). An overflow skips the step: the caller
steps neither the optimizer nor the LR scheduler, and the scale halves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from veoptim.distributed import ParallelPlan
from veoptim.optim.loss_scale import DynamicLossScaler

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class ScaledStep:
    """What a loss-scaled step did: the unscaled gradient norm, whether it was skipped,
    and the scale its backward ran with."""

    grad_norm: float
    skipped: bool
    scale: float


def scaled_update(
    plan: ParallelPlan,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    max_norm: float,
    step: int,
) -> ScaledStep:
    """Step ``optimizer`` on the scaled gradients, or skip an overflowed step ``step``;
    then update the scale. Collective (the norm is all-reduced): every rank decides alike."""
    scale = scaler.scale
    norm = float(plan.grad_norm(model)) / scale
    if not math.isfinite(norm):
        scaler.update(found_inf=True, step=step)
        return ScaledStep(norm, True, scale)
    coef = min(1.0, max_norm / (norm + CLIP_EPS)) if 0 < max_norm < math.inf else 1.0
    optimizer.step(grad_divisor=scale / coef)
    scaler.update(found_inf=False, step=step)
    return ScaledStep(norm, False, scale)
