"""One fused mixed-dtype AdamW kernel per tensor for CUDA and NPU, built with ``torch.compile``.

torch's ``_fused_adamw_`` takes one dtype per call, so the eager engine
(``eager.py``) widens BF16 gradients/moments into FP32 scratch and narrows
them back: one extra pass per narrow operand. On an accelerator the same update
written as plain tensor ops and compiled by inductor is one kernel that reads the
FP32 master, the gradient and the moments in their stored dtypes once and writes
master, moments and the BF16 parameter once (as torchao's low-bit optimizers do).

The math is torch's fused AdamW (decoupled weight decay, ``lerp`` first moment,
bias corrections from the step in FP64), evaluated in FP32. It is not bitwise
the eager kernel (operation order and FMA contraction differ; torch's CUDA fused
kernel itself mixes FP64 and FP32): the uncompiled function tracks the eager CPU
update within the tolerance ``tests/optim/test_compiled_kernel.py`` states.
Resume stays bitwise because a resumed run uses the same kernel.

Selection (``kernel=`` of the exact optimizers): ``"auto"`` compiles on cuda and npu
(on CPU it takes the native kernel, ``native.py``); ``"eager"`` never compiles;
``"compiled"`` compiles on any device (CPU needs a C++ compiler). Stochastic rounding always
uses the eager engine (its noise hash is defined there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from veoptim.optim.kernels.eager import Hyper, UpdateBatch

LOG = logging.getLogger(__name__)

#: Devices where ``kernel="auto"`` compiles the update.
COMPILED_DEVICE_TYPES = ("cuda", "npu")


def adamw_mixed_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor | None,
    step: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """AdamW on one FP32 master with gradient/moments in their own dtype, all updated in place.

    ``step`` (already incremented) and ``lr`` are 0-d tensors on the device, so a new
    step or LR needs no recompilation and no host sync; ``param`` (None where the
    master is the parameter) receives the master rounded to nearest.
    """
    g = grad.float()
    if maximize:
        g = -g
    s = step.double()
    lr64 = lr.double()
    step_size = (lr64 / (1.0 - beta1**s)).float()
    bc2_sqrt = torch.sqrt(1.0 - beta2**s).float()
    decay = (1.0 - lr64 * weight_decay).float()
    m = torch.lerp(exp_avg.float(), g, 1.0 - beta1)
    v = exp_avg_sq.float() * beta2 + (1.0 - beta2) * g * g
    denom = v.sqrt() / bc2_sqrt + eps
    p = master * decay - step_size * m / denom
    master.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if param is not None:
        param.copy_(p)


_COMPILED: dict[str, Callable[..., None] | None] = {}


def compiled_for(device: torch.device) -> Callable[..., None] | None:
    """The compiled kernel for ``device``'s type (built once), or None where compiling failed."""
    if device.type not in _COMPILED:
        _COMPILED[device.type] = torch.compile(adamw_mixed_, fullgraph=True, dynamic=True)
    return _COMPILED[device.type]


def use_compiled(kernel: str, device_type: str, sr: bool) -> bool:
    """Whether a resident update on ``device_type`` goes to the compiled kernel."""
    if sr or kernel == "eager":
        return False
    if kernel == "auto" and device_type not in COMPILED_DEVICE_TYPES:
        return False
    return _COMPILED.get(device_type, True) is not None


def compiled_update_(batch: UpdateBatch, hp: Hyper, device: torch.device) -> bool:
    """Update every tensor of ``batch`` with the compiled kernel; False if it cannot compile.

    Tensors that need no conversion (FP32 gradient and moments, master is the
    parameter) go through one ``_fused_adamw_`` call, bitwise torch's AdamW.
    """
    fn = compiled_for(device)
    if fn is None:
        return False
    plain = [
        i
        for i, (g, m, o) in enumerate(zip(batch.grads, batch.exp_avgs, batch.outs, strict=True))
        if o is None and g.dtype == m.dtype == torch.float32
    ]
    skip = set(plain)
    mixed = [i for i in range(len(batch.masters)) if i not in skip]
    lr = torch.tensor(hp.lr, dtype=torch.float64, device=device)
    for n, i in enumerate(mixed):
        args = (
            batch.masters[i],
            batch.grads[i],
            batch.exp_avgs[i],
            batch.exp_avg_sqs[i],
            batch.outs[i],
            batch.steps[i],
            lr,
            hp.beta1,
            hp.beta2,
            hp.eps,
            hp.weight_decay,
            hp.maximize,
        )
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any backend failure means: use eager
            if n:  # a later tensor failed after earlier ones were updated: not recoverable
                raise
            LOG.warning(
                "torch.compile of the AdamW kernel failed on %s (%s: %s); using the eager "
                "engine on this device type.",
                device.type,
                type(exc).__name__,
                exc,
            )
            _COMPILED[device.type] = None
            return False
    if plain:
        pick = [batch.masters[i] for i in plain]
        torch._fused_adamw_(
            pick,
            [batch.grads[i] for i in plain],
            [batch.exp_avgs[i] for i in plain],
            [batch.exp_avg_sqs[i] for i in plain],
            [],
            [batch.steps[i] for i in plain],
            **hp.kernel_kwargs(),
        )
    return True
