"""A recording stand-in for ``torch_npu``: the npu path runs on a host without CANN.

``install_fake_npu(monkeypatch)`` puts a fake ``torch_npu`` in ``sys.modules`` and
registers a fake ``torch.npu`` device module, as importing (or torch autoloading)
the real package does; both are undone when the test ends. The fake device module
has what veoptim's :class:`~veoptim.distributed.device.Accelerator` uses of
``torch.npu`` (availability, device count and selection, per-device RNG states,
events on the current stream, synchronisation) and appends every call to
``calls``, so a test can say which device calls the npu path made and in what order.
Tensors stay on the CPU: the fake has no memory of its own.

Like torch_npu, the fake renames torch's PrivateUse1 backend to ``npu`` (so that
``torch.device("npu", 0)`` parses). That cannot be undone and makes
``torch.accelerator`` raise for the rest of the process, so it is only allowed in
an interpreter started for it: ``tests/distributed/test_npu_path.py`` runs the
suites that use the fake in one (with ``VEOPTIM_FAKE_NPU=1``).
"""

from __future__ import annotations

import os
import sys
import types
from itertools import count
from typing import Any

import pytest
import torch

NPU_MODULE = "torch_npu"
#: Set in the interpreter that may rename PrivateUse1 (see the module docstring).
FAKE_NPU_ENV = "VEOPTIM_FAKE_NPU"
RNG_STATE_BYTES = 16  # torch_npu's generator state: seed and offset


class FakeStream:
    """The current stream of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"FakeStream({self.device})"


class FakeEvent:
    """Records ``record(stream)`` and ``synchronize()`` in its module's call log."""

    def __init__(self, module: FakeNPU, ident: int) -> None:
        self.module, self.id = module, ident
        self.stream: FakeStream | None = None
        self.synchronized = 0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream
        self.module.calls.append(("event.record", self.id, stream.device if stream else None))

    def synchronize(self) -> None:
        self.synchronized += 1
        self.module.calls.append(("event.synchronize", self.id))


class FakeNPU(types.ModuleType):
    """The fake ``torch.npu``: ``count`` devices, each with its own RNG state."""

    def __init__(self, device_count: int = 8, available: bool = True) -> None:
        super().__init__("torch.npu")
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []
        self.count, self.available, self.current = device_count, available, 0
        self.rng = {
            i: torch.arange(RNG_STATE_BYTES, dtype=torch.uint8) + i for i in range(device_count)
        }
        self._ids = count()

    def _index(self, device: torch.device | int | str | None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        assert device.type == "npu", f"torch.npu was asked about {device}"
        return self.current if device.index is None else device.index

    def is_available(self) -> bool:
        self.calls.append(("is_available",))
        return self.available

    def device_count(self) -> int:
        self.calls.append(("device_count",))
        return self.count

    def set_device(self, device: int) -> None:
        self.calls.append(("set_device", device))
        self.current = self._index(device)

    def get_rng_state(self, device: torch.device | int | str = "npu") -> torch.Tensor:
        index = self._index(device)
        self.calls.append(("get_rng_state", index))
        return self.rng[index].clone()

    def set_rng_state(self, new_state: torch.Tensor, device: torch.device | int | str = "npu"):
        index = self._index(device)
        self.calls.append(("set_rng_state", index))
        assert new_state.dtype == torch.uint8 and new_state.device.type == "cpu"
        self.rng[index] = new_state.clone()

    def current_stream(self, device: torch.device | int | None = None) -> FakeStream:
        index = self._index(device)
        self.calls.append(("current_stream", index))
        return FakeStream(torch.device("npu", index))

    def Event(self) -> FakeEvent:  # the class name torch.npu.Event, a factory here
        event = FakeEvent(self, next(self._ids))
        self.events.append(event)
        self.calls.append(("Event", event.id))
        return event

    def synchronize(self, device: torch.device | int | None = None) -> None:
        self.calls.append(("synchronize", self._index(device)))

    def names(self) -> list[str]:
        """The names of the calls so far, in order."""
        return [c[0] for c in self.calls]


def name_privateuse1_npu() -> None:
    """Rename torch's PrivateUse1 backend to ``npu``, as torch_npu does (once per process)."""
    if os.environ.get(FAKE_NPU_ENV) != "1":
        raise RuntimeError(
            f"the fake torch_npu renames torch's PrivateUse1 backend for the whole process; "
            f"run it in its own interpreter with {FAKE_NPU_ENV}=1 "
            "(tests/distributed/test_npu_path.py does)."
        )
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")


def register_fake_npu() -> FakeNPU:
    """What ``import torch_npu`` does, for good: ``torch.npu`` becomes a fake (subprocesses)."""
    name_privateuse1_npu()
    fake = FakeNPU()
    torch.npu = fake  # type: ignore[attr-defined]
    return fake


def install_fake_npu(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> FakeNPU:
    """Make ``torch_npu`` importable and ``torch.npu`` the returned fake, for one test."""
    name_privateuse1_npu()
    fake = FakeNPU(**kwargs)
    package = types.ModuleType(NPU_MODULE)
    package.npu = fake  # type: ignore[attr-defined]  # torch_npu.npu is torch.npu
    monkeypatch.setitem(sys.modules, NPU_MODULE, package)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    return fake
