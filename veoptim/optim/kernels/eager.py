"""The AdamW arithmetic of every exact-precision optimizer: ``torch._fused_adamw_`` on FP32.

One kernel does the update everywhere (resident and offloaded groups, CPU and
accelerators), on FP32 masters and FP32 moments. Where a gradient or a moment is
stored in a narrower dtype, the tensors are processed in batches of at most
``chunk`` elements: the narrow operands are widened into a reused FP32 scratch,
updated, rounded back (round-to-nearest-even) and the parameter written from the
master, while the batch is still in cache. Segment starts are multiples of
:data:`ALIGN` elements so every element takes the same vector/scalar path as in a
single whole-tensor call: the result is bitwise independent of the chunk size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from veoptim.optim.rounding import write_back_

#: Segment starts are multiples of this many elements. The CPU fused kernel
#: splits work at cache-line multiples and vectorises from each split point; 64
#: covers every float vector width (AVX2, AVX-512, NEON, SVE up to 2048 bit).
ALIGN = 64
#: Default batch size of the resident path: 1 Mi elements (4 MiB of FP32 scratch per
#: widened operand). Measured on CPU: smaller batches lose more to per-call overhead
#: than they gain from cache reuse; larger ones only cost scratch memory.
DEFAULT_FUSED_CHUNK = 1 << 20


def align_chunk(chunk: int) -> int:
    """Round a chunk size down to a multiple of :data:`ALIGN` (at least ALIGN)."""
    return max(ALIGN, chunk - chunk % ALIGN)


@dataclass(frozen=True)
class Hyper:
    """AdamW hyperparameters of one param group, as the fused kernel takes them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    #: Every gradient is divided by this in FP32 before the update (fp16 loss scaling
    #: folded with the clip coefficient; 1: the gradients as they are).
    grad_divisor: float = 1.0

    @property
    def scaled(self) -> bool:
        return self.grad_divisor != 1.0

    def kernel_kwargs(self) -> dict:
        return dict(
            lr=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            weight_decay=self.weight_decay,
            eps=self.eps,
            amsgrad=False,
            maximize=self.maximize,
        )


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, end)`` of tensor ``index`` of a tensor list."""

    index: int
    start: int
    end: int


def plan_batches(numels: list[int], chunk: int) -> list[list[Segment]]:
    """Split tensors into aligned segments and pack them into batches of <= chunk elements."""
    chunk = align_chunk(chunk)
    batches: list[list[Segment]] = []
    current: list[Segment] = []
    filled = 0
    for i, n in enumerate(numels):
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            if filled + end - start > chunk:
                batches.append(current)
                current, filled = [], 0
            current.append(Segment(i, start, end))
            filled += end - start
    if current:
        batches.append(current)
    return batches


class Scratch:
    """Reused FP32 work buffers of one device (grad, exp_avg, exp_avg_sq), grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get((name, device))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffers[(name, device)] = buf
        return buf

    def clear(self) -> None:
        self._buffers.clear()


@dataclass
class UpdateBatch:
    """Flat (1-D, contiguous) local tensors of the parameters updated together."""

    masters: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    #: Parameter written from the master after the update; None where the master is the parameter.
    outs: list[torch.Tensor | None]
    #: Stochastic-rounding noise key and global index of element 0, per tensor.
    sr_keys: list[int]
    sr_offsets: list[int]


def scratch_views(
    scratch: Scratch, name: str, sizes: list[int], total: int, device: torch.device
) -> list[torch.Tensor]:
    """Consecutive views of sizes ``sizes`` into the FP32 scratch buffer ``name``."""
    return list(scratch.get(name, total, device)[:total].split(sizes))


@functools.lru_cache(maxsize=64)
def _cached_plan(numels: tuple[int, ...], chunk: int) -> tuple[tuple[Segment, ...], ...]:
    return tuple(tuple(b) for b in plan_batches(list(numels), chunk))


def _segment(t: torch.Tensor, s: Segment) -> torch.Tensor:
    """``t[start:end]``; the tensor itself when the segment covers it (one op less)."""
    return t if s.start == 0 and s.end == t.numel() else t[s.start : s.end]


class _Widened:
    """The kernel's FP32 operand list for one batch, and the copies that fill/drain it."""

    def __init__(
        self, scratch: Scratch, name: str, store: list[torch.Tensor], sizes: list[int], total: int
    ) -> None:
        self.store = store
        self.narrow = any(t.dtype != torch.float32 for t in store)
        self.fp32 = (
            scratch_views(scratch, name, sizes, total, store[0].device) if self.narrow else store
        )


def adamw_update_(batch: UpdateBatch, hp: Hyper, scratch: Scratch, chunk: int, sr: bool) -> None:
    """One AdamW update of every tensor in ``batch`` (steps already incremented).

    Per batch of segments: one ``_foreach_copy_`` widens every narrow operand (gradient,
    moments) into scratch, one fused kernel updates, one ``_foreach_copy_`` narrows the
    moments back and writes the parameters from the masters (RNE). Fewer dispatches per
    batch let the batches be small enough for the widened operands to stay in L2.
    """
    if not batch.masters:
        return
    kwargs = hp.kernel_kwargs()
    if hp.scaled:  # the fused kernel divides each (widened) gradient in FP32
        kwargs["grad_scale"] = torch.tensor(
            hp.grad_divisor, dtype=torch.float32, device=batch.masters[0].device
        )
    narrow = any(g.dtype != torch.float32 for g in batch.grads) or any(
        m.dtype != torch.float32 for m in batch.exp_avgs + batch.exp_avg_sqs
    )
    if not narrow and all(o is None for o in batch.outs):
        torch._fused_adamw_(
            batch.masters, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, [], batch.steps, **kwargs
        )
        return
    for segs in _cached_plan(tuple(m.numel() for m in batch.masters), align_chunk(chunk)):
        sizes = [s.end - s.start for s in segs]
        total = sum(sizes)
        masters = [_segment(batch.masters[s.index], s) for s in segs]
        operands = [
            _Widened(scratch, name, [_segment(store[s.index], s) for s in segs], sizes, total)
            for name, store in (
                ("grad", batch.grads),
                ("exp_avg", batch.exp_avgs),
                ("exp_avg_sq", batch.exp_avg_sqs),
            )
        ]
        widen = [w for w in operands if w.narrow]
        if widen:
            torch._foreach_copy_(
                [t for w in widen for t in w.fp32], [t for w in widen for t in w.store]
            )
        grads, m32, v32 = (w.fp32 for w in operands)
        steps = [batch.steps[s.index] for s in segs]
        torch._fused_adamw_(masters, grads, m32, v32, [], steps, **kwargs)
        dst = [t for w in operands[1:] if w.narrow for t in w.store]
        src = [t for w in operands[1:] if w.narrow for t in w.fp32]
        pairs = [(i, s) for i, s in enumerate(segs) if batch.outs[s.index] is not None]
        if pairs and not sr:
            dst += [_segment(batch.outs[s.index], s) for _, s in pairs]
            src += [masters[i] for i, _ in pairs]
        if dst:
            torch._foreach_copy_(dst, src)
        if pairs and sr:
            write_back_(
                [_segment(batch.outs[s.index], s) for _, s in pairs],
                [masters[i] for i, _ in pairs],
                stochastic=True,
                keys=[batch.sr_keys[s.index] for _, s in pairs],
                first_indices=[batch.sr_offsets[s.index] + s.start for _, s in pairs],
            )
