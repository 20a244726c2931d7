"""The AdamW update kernels behind one door: :func:`select` picks, ``update_`` runs.

An exact optimizer builds an :class:`UpdateBatch` of its parameters' flat tensors, increments
their steps and makes one call, ``select(...).update_(batch, hyper)``. The backends share the
batch types of ``eager.py``:

- ``eager.py``: torch's ``_fused_adamw_`` on FP32, narrow operands widened and narrowed in
  scratch; the reference arithmetic, and the only kernel with stochastic rounding.
- ``native.py`` (compiled from ``adamw.c`` on first use): the one-pass CPU kernel, bitwise
  the eager one for every dtype combination, checked against it before first use.
- ``compiled.py``: the same update through ``torch.compile`` on cuda and npu (not bitwise
  the eager one; a resumed run uses the same kernel, so resume stays bitwise).

``kernel=`` of the exact optimizers: ``auto`` (native on CPU where it builds and there is
something to convert, compiled on cuda/npu, else eager), ``eager``, ``compiled``. A step
whose gradients are divided first (``Hyper.grad_divisor``: fp16 loss scaling) always runs
on the eager engine, whose fused kernel divides each gradient in FP32. Offloaded
groups stage device gradients to the host chunk by chunk (``optim/offload.py``); their host
update is :func:`select_host`'s, chunk by chunk. A new kernel is one module with an ``update_`` and its
line in :func:`select`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from veoptim.errors import ConfigError
from veoptim.optim.kernels.compiled import compiled_update_, use_compiled
from veoptim.optim.kernels.eager import (
    DEFAULT_FUSED_CHUNK,
    Hyper,
    Scratch,
    UpdateBatch,
    adamw_update_,
    align_chunk,
)
from veoptim.optim.kernels.native import NativeKernel, native_for

KERNELS = ("auto", "eager", "compiled")


def check_kernel(kernel: object) -> str:
    """``kernel=`` of the exact optimizers, checked."""
    if kernel not in KERNELS:
        raise ConfigError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}.")
    return str(kernel)


class Kernel(Protocol):
    #: Widens and narrows its operands in the same pass as the update: an offloaded batch
    #: on a CPU "device" goes to it whole, with nothing to stage.
    one_pass: bool

    def update_(self, batch: UpdateBatch, hp: Hyper) -> None:
        """One AdamW step of every tensor of ``batch`` (steps already incremented)."""


@dataclass(frozen=True)
class EagerKernel:
    """torch's fused AdamW on FP32, with the optimizer's scratch for narrow operands."""

    scratch: Scratch
    chunk: int
    stochastic_rounding: bool
    one_pass = False

    def update_(self, batch: UpdateBatch, hp: Hyper) -> None:
        adamw_update_(batch, hp, self.scratch, self.chunk, self.stochastic_rounding)


@dataclass(frozen=True)
class CompiledKernel:
    """The compiled update on ``device``; the eager one where compiling fails."""

    device: torch.device
    fallback: EagerKernel
    one_pass = False

    def update_(self, batch: UpdateBatch, hp: Hyper) -> None:
        if not compiled_update_(batch, hp, self.device):
            self.fallback.update_(batch, hp)


def select(
    kernel: str,
    batch: UpdateBatch,
    *,
    stochastic_rounding: bool,
    scratch: Scratch,
    chunk: int,
    scaled: bool = False,
) -> Kernel:
    """The kernel that updates ``batch``, whose tensors are all on one device (``scaled``:
    the gradients are divided first, which only the eager engine does)."""
    sr = stochastic_rounding
    if scaled:
        return EagerKernel(scratch, chunk, sr)
    native = native_for(kernel, batch, sr)
    if native is not None:
        return native
    eager = EagerKernel(scratch, chunk, sr)
    device = batch.masters[0].device
    if use_compiled(kernel, device.type, sr):
        return CompiledKernel(device, eager)
    return eager


def select_host(
    kernel: str,
    batch: UpdateBatch,
    *,
    stochastic_rounding: bool,
    scratch: Scratch,
    chunk: int,
    scaled: bool = False,
) -> Kernel:
    """The host kernel of an offloaded batch (host masters and moments, gradients staged
    from the device): the one-pass native kernel where it runs, else the eager one on the
    host's ``scratch``; ``optim/offload.py`` feeds it the staged chunks."""
    sr = stochastic_rounding
    native = None if scaled else native_for(kernel, batch, sr, offloaded=True)
    return native if native is not None else EagerKernel(scratch, chunk, sr)


__all__ = [
    "DEFAULT_FUSED_CHUNK",
    "KERNELS",
    "CompiledKernel",
    "EagerKernel",
    "Hyper",
    "Kernel",
    "NativeKernel",
    "Scratch",
    "UpdateBatch",
    "align_chunk",
    "check_kernel",
    "select",
    "select_host",
]
