"""Streaming update of offloaded groups through a bounded host staging buffer.

Masters and moments of offloaded parameters live in host memory; the compute
parameter and its gradient stay on their device. Per chunk of ``chunk``
elements: the gradient segment is copied device -> host into one of two reused
grad slots (the next chunk's copy is issued before the current chunk is
computed), the host runs the fused FP32 AdamW on the segment, the rounded
parameter segment is written into one reused write-back slot and copied
host -> device. Before a slot is read, reused or grown, the transfers it is
part of are waited for. Slots are allocated once (pinned where the device is an
accelerator) and reused across chunks and parameters, so pinned memory stays at
``3 * chunk * 4`` bytes whatever the model size. On a CPU-only run the same
chunked code runs with plain synchronous copies; there the gradient is widened
to FP32 while it is fetched and the parameter is written from the master in
place (no transfer to overlap, so the extra slot copies would only cost passes).

Everything device-specific (pinned allocation, non-blocking copies, events on
the device's current stream) is the device's :class:`Accelerator`
(``veoptim/distributed/device.py``): the same code runs on cuda and Ascend npu.
"""

from __future__ import annotations

import torch

from veoptim.distributed.device import Event, accelerator
from veoptim.optim.kernels import Hyper, Kernel, UpdateBatch, align_chunk

_SLOT_ITEMSIZE = 4  # widest supported parameter/gradient dtype (FP32)


class _Slot:
    """One pinned byte buffer plus the event of the last transfer that touches it."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.event: Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class StagingBuffer:
    """Host staging of one compute device: two grad slots and one write-back slot."""

    def __init__(self, chunk: int, device: torch.device) -> None:
        self.chunk = align_chunk(chunk)
        self.device = device
        self.accel = accelerator(device)
        self._grad = [_Slot(), _Slot()]
        self._out = _Slot()
        self.allocations = 0  # number of slot (re)allocations, for tests and benchmarks

    def _view(self, slot: _Slot, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if slot.buf is None or slot.buf.numel() < nbytes:
            slot.wait()  # never free or replace a buffer a transfer still uses
            size = max(nbytes, self.chunk * _SLOT_ITEMSIZE)
            slot.buf = self.accel.host_buffer(size)
            self.allocations += 1
        return slot.buf[:nbytes].view(dtype)

    def _record(self, slot: _Slot) -> None:
        slot.event = self.accel.record_event(self.device)

    def reserve(self) -> None:
        """Allocate the three slots at ``chunk`` elements of the widest dtype (once)."""
        for slot in (*self._grad, self._out):
            self._view(slot, self.chunk, torch.float32)

    def fetch(self, k: int, src: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Start copying a device gradient segment into grad slot ``k % 2`` (as ``dtype``)."""
        slot = self._grad[k % 2]
        slot.wait()
        self.accel.copy_(self._view(slot, src.numel(), dtype or src.dtype), src)
        self._record(slot)

    def fetched(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The gradient segment of grad slot ``k % 2`` once its copy has landed."""
        slot = self._grad[k % 2]
        slot.wait()
        return self._view(slot, numel, dtype)

    def out(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The write-back slot, after its previous host -> device copy has completed."""
        self._out.wait()
        return self._view(self._out, numel, dtype)

    def push(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the write-back slot contents ``src`` to the device segment ``dst``."""
        self.accel.copy_(dst, src)
        self._record(self._out)


def offload_update_(batch: UpdateBatch, hp: Hyper, staging: StagingBuffer, kernel: Kernel) -> None:
    """AdamW update of host-resident masters/moments from device gradients, chunk by chunk,
    each chunk by ``kernel`` (``kernels.select_host``'s); a one-pass kernel on a CPU
    "device" takes the whole batch (nothing to stage; the chunks are aligned, so it is the
    same arithmetic)."""
    if kernel.one_pass and staging.device.type == "cpu":
        kernel.update_(batch, hp)
        return
    chunk = staging.chunk
    jobs = [
        (i, start, min(m.numel(), start + chunk))
        for i, m in enumerate(batch.masters)
        for start in range(0, m.numel(), chunk)
    ]
    if not jobs:
        return
    staging.reserve()
    # A CPU "device": nothing to overlap, so widen while fetching and write the parameter in place.
    direct = staging.device.type == "cpu"
    fetch_dtype = torch.float32 if direct else None
    i0, s0, e0 = jobs[0]
    staging.fetch(0, batch.grads[i0][s0:e0], fetch_dtype)
    for k, (i, start, end) in enumerate(jobs):
        if k + 1 < len(jobs):
            ni, ns, ne = jobs[k + 1]
            staging.fetch(k + 1, batch.grads[ni][ns:ne], fetch_dtype)
        n = end - start
        grad = staging.fetched(k, n, fetch_dtype or batch.grads[i].dtype)
        param = batch.outs[i]
        assert param is not None, "an offloaded master never aliases its device parameter"
        out = param[start:end] if direct else staging.out(n, param.dtype)
        kernel.update_(_host_segment(batch, i, start, end, grad, out), hp)
        if not direct:
            staging.push(param[start:end], out)


def _host_segment(
    batch: UpdateBatch, i: int, start: int, end: int, grad: torch.Tensor, out: torch.Tensor
) -> UpdateBatch:
    """Elements ``[start, end)`` of tensor ``i``: host state, staged gradient and output
    (with stochastic rounding, the noise of those elements: same key, offset by ``start``)."""
    rounding = bool(batch.sr_keys)
    return UpdateBatch(
        masters=[batch.masters[i][start:end]],
        grads=[grad],
        exp_avgs=[batch.exp_avgs[i][start:end]],
        exp_avg_sqs=[batch.exp_avg_sqs[i][start:end]],
        steps=[batch.steps[i]],
        outs=[out],
        sr_keys=[batch.sr_keys[i]] if rounding else [],
        sr_offsets=[batch.sr_offsets[i] + start] if rounding else [],
    )
