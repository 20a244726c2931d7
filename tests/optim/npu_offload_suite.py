"""The offload staging's accelerator branch on Ascend npu, driven through a fake torch_npu.

Runs in an interpreter of its own (``tests/distributed/test_npu_path.py``; the fake
renames torch's PrivateUse1 backend for good, see ``tests/distributed/fake_npu.py``).
The staging buffer of the (host-resident) test parameters is made the one of
``npu:0``, so the accelerator code path runs on CPU tensors: pinned slot
allocation, non-blocking copies and events on npu:0's current stream through the
recording ``torch.npu``. A CPU-only torch pins nothing, so the pinned allocations
are recorded and served unpinned; the copies land at once, so the arithmetic must
be bitwise the plain CPU path's, and the recorded calls must show the transfer
protocol that makes it safe on a device: every slot is reused only after the event
of its previous transfer was waited for, and each event is waited for exactly once.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.fake_npu import FAKE_NPU_ENV, FakeNPU, install_fake_npu
from tests.optim.helpers import HYPER, make_params, masters, run_variant, set_grads
from veoptim.optim import EXP_AVG, EXP_AVG_SQ, CPUOffloadAdamW
from veoptim.optim.offload import StagingBuffer

if os.environ.get(FAKE_NPU_ENV) != "1":
    pytest.skip(
        f"renames torch's PrivateUse1 backend; run by tests/distributed/test_npu_path.py "
        f"(or with {FAKE_NPU_ENV}=1 on its own)",
        allow_module_level=True,
    )

HOST = torch.device("cpu")
STEPS = 4
ALL = len(make_params(torch.float32))


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNPU:
    fake = install_fake_npu(monkeypatch)
    real_empty = torch.empty

    def empty(*size, pin_memory: bool = False, **kwargs):
        if pin_memory:
            fake.calls.append(("pinned", *size))
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return fake


def _npu_staged(chunk: int, kernel: str = "auto"):
    """CPUOffloadAdamW whose offloaded parameters stream through npu:0's staging (the host
    update by the native kernel with "auto", by the eager engine with "eager")."""

    def factory(groups):
        opt = CPUOffloadAdamW(groups, chunk_size=chunk, kernel=kernel, **HYPER)
        opt._staging[HOST] = StagingBuffer(chunk, torch.device("npu", 0))
        return opt

    return factory


def _cpu(chunk: int):
    return lambda groups: CPUOffloadAdamW(groups, chunk_size=chunk, kernel="eager", **HYPER)


@pytest.mark.parametrize("kernel", ["auto", "eager"])
@pytest.mark.parametrize("chunk", [256, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_npu_staging_is_bitwise_the_cpu_update(npu, chunk, dtype, kernel):
    np_, no = run_variant(_npu_staged(chunk, kernel), STEPS, dtype, ALL)
    cp, co = run_variant(_cpu(chunk), STEPS, dtype, ALL)
    assert all(torch.equal(a, b) for a, b in zip(np_, cp, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masters(no, np_), masters(co, cp), strict=True))
    for key in (EXP_AVG, EXP_AVG_SQ):
        pairs = zip(np_, cp, strict=True)
        assert all(torch.equal(no.state[a][key], co.state[b][key]) for a, b in pairs)
    staging = no._staging[HOST]
    assert staging.accel.module is npu
    pinned = [c for c in npu.calls if c[0] == "pinned"]
    assert pinned == [("pinned", staging.chunk * 4)] * 3, "three slots, pinned, allocated once"
    assert staging.allocations == 3


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_transfers_are_non_blocking_and_each_slot_waits_for_its_last_event(npu, monkeypatch):
    params = make_params(torch.bfloat16)
    opt = _npu_staged(256)([{"params": params, "cpu_offload": True}])
    staging = opt._staging[HOST]
    set_grads(params, 0, torch.bfloat16)
    opt.step()  # state initialised; the step below is recorded
    set_grads(params, 1, torch.bfloat16)
    grads = {_storage(p.grad) for p in params}
    outs = {_storage(p) for p in params}
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if _storage(src) in grads:
            npu.calls.append(("fetch", non_blocking))  # device gradient -> grad slot
        elif _storage(self) in outs:
            npu.calls.append(("push", non_blocking))  # write-back slot -> device parameter
        return real_copy(self, src, non_blocking)

    del npu.calls[:]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_", copy_)
        opt.step()
    for slot in (*staging._grad, staging._out):  # wait for the transfers still outstanding
        slot.wait()
    calls = npu.calls

    chunks = sum(-(-p.numel() // staging.chunk) for p in params)
    fetches = [i for i, c in enumerate(calls) if c[0] == "fetch"]
    pushes = [i for i, c in enumerate(calls) if c[0] == "push"]
    assert len(fetches) == len(pushes) == chunks
    assert all(calls[i][1] is True for i in fetches + pushes), "every transfer is non-blocking"
    assert not [c for c in calls if c[0] == "pinned"], "no slot is allocated again"

    def event_after(i: int) -> int:
        """The event recorded right after transfer ``i``, on npu:0's current stream."""
        (name, ident), stream, record = calls[i + 1 : i + 4]
        assert name == "Event" and stream == ("current_stream", 0)
        assert record == ("event.record", ident, torch.device("npu", 0))
        return ident

    fetch_event = [event_after(i) for i in fetches]
    push_event = [event_after(i) for i in pushes]

    def waited_before(ident: int, position: int) -> bool:
        return ("event.synchronize", ident) in calls[:position]

    for k in range(chunks):
        # the gradient of chunk k is read (then pushed) only after its copy landed
        assert waited_before(fetch_event[k], pushes[k])
        if k >= 2:  # grad slot k % 2 is overwritten only after chunk k-2's copy landed
            assert waited_before(fetch_event[k - 2], fetches[k])
        if k >= 1:  # the write-back slot is refilled only after the last push landed
            assert waited_before(push_event[k - 1], pushes[k])
    assert sorted(e.synchronized for e in npu.events) == [1] * len(npu.events), (
        "after the last waits every event was waited for exactly once"
    )
