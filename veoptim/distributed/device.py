"""Device abstraction: cpu, cuda and Ascend npu, and the process-group backend of each.

Everything veoptim does that differs by device type goes through this module:
resolving ``run.device`` and ``parallel.backend``, importing ``torch_npu``, and
the :class:`Accelerator` of a device type (device count and selection, the
device RNG state, host staging buffers, copies, events and synchronisation).
On cuda and npu those go through the device module ``torch.cuda`` /
``torch.npu``; ``torch_npu`` registers ``torch.npu``, which is also the seam the
tests replace with a recording fake (``tests/distributed/fake_npu.py``).

``torch_npu`` is imported only here and only for the ``npu`` device type:
installing it on a host without CANN breaks ``import torch`` (torch imports the
``torch.backends`` entry point of every installed device package unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), so it is an optional extra and never a test
dependency. When torch has already autoloaded it, the import here is a no-op.
See docs/ascend.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from veoptim.errors import ConfigError, DistributedError

DEVICE_NAMES = ("auto", "cpu", "cuda", "npu")
BACKEND_NAMES = ("auto", "gloo", "nccl", "hccl")
DEFAULT_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
HOST = "cpu"
NPU = "npu"
NPU_MODULE = "torch_npu"


def _import_torch_npu() -> None:
    """Import torch_npu (registers ``torch.npu``) or say how to get it.

    A no-op when it is already imported (autoloaded by ``import torch``, or an
    earlier call).
    """
    try:
        importlib.import_module(NPU_MODULE)
    except (ImportError, OSError, RuntimeError) as exc:  # missing, or a broken CANN install
        raise DistributedError(
            f"run.device=npu needs the optional package {NPU_MODULE} (Ascend CANN toolkit); "
            f"importing it failed: {exc}. Install the 'npu' extra and source CANN's set_env.sh "
            "(docs/ascend.md)."
        ) from exc


def device_module(device_type: str) -> ModuleType:
    """The device module of an accelerator type: ``torch.cuda`` or ``torch.npu``.

    For npu, imports torch_npu first (it registers ``torch.npu``).
    """
    if device_type not in DEFAULT_BACKENDS or device_type == HOST:
        raise DistributedError(
            f"no device module for device type {device_type!r}; "
            f"accelerators are {[t for t in DEFAULT_BACKENDS if t != HOST]}."
        )
    if device_type == NPU:
        _import_torch_npu()
    module = getattr(torch, device_type, None)
    if module is None:
        raise DistributedError(
            f"{NPU_MODULE} was imported but did not register torch.{device_type}; "
            "the installed torch-npu does not match this torch (docs/ascend.md)."
        )
    return module


class Event(Protocol):
    """What veoptim uses of a device event (``torch.cuda.Event`` / ``torch.npu.Event``)."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Accelerator:
    """The device-specific operations of one device type, one way each.

    ``module`` is the device module (``torch.cuda`` / ``torch.npu``), or None for
    the host (cpu). On the host there is no device to count or select and no
    device RNG; staging buffers are ordinary host memory, copies are synchronous
    and no events are recorded. On an accelerator, staging buffers are pinned,
    host <-> device copies are non-blocking and an event recorded on the device's
    current stream tells when one has landed.
    """

    type: str
    module: ModuleType | None

    @property
    def is_host(self) -> bool:
        return self.module is None

    def _device(self) -> ModuleType:
        assert self.module is not None, f"{self.type} is the host: it has no device module"
        return self.module

    def is_available(self) -> bool:
        return self._device().is_available()

    def device_count(self) -> int:
        return self._device().device_count()

    def set_device(self, index: int) -> None:
        """Make device ``index`` of this type the current one (collectives and FSDP2 use it)."""
        self._device().set_device(index)

    def get_rng_state(self, device: torch.device) -> torch.Tensor | None:
        """The RNG state of ``device`` (a uint8 tensor), or None on the host (torch's CPU
        generator is saved on its own)."""
        return None if self.module is None else self.module.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        """Install a state from :meth:`get_rng_state` on ``device`` (nothing on the host)."""
        if self.module is not None:
            self.module.set_rng_state(state, device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer for device transfers: pinned on an accelerator."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.is_host)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, non-blocking between a pinned host buffer and a device."""
        dst.copy_(src, non_blocking=not self.is_host)

    def record_event(self, device: torch.device) -> Event | None:
        """An event recorded on ``device``'s current stream, where copies to and from it
        are queued; None on the host, whose copies have completed on return.
        Wait for it with ``event.synchronize()``."""
        if self.module is None:
            return None
        event = self.module.Event()
        event.record(self.module.current_stream(device))
        return event

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work queued on ``device`` (nothing to wait for on the host)."""
        if self.module is not None:
            self.module.synchronize(device)


def accelerator(device: torch.device | str) -> Accelerator:
    """The :class:`Accelerator` of a device, or of a device type named ``cpu|cuda|npu``.

    A name is not parsed as ``torch.device``: ``"npu"`` only parses once torch_npu
    is imported, which this does.
    """
    device_type = device if isinstance(device, str) else device.type
    if device_type == HOST:
        return Accelerator(HOST, None)
    return Accelerator(device_type, device_module(device_type))


def resolve_device(name: str) -> torch.device:
    """Map ``run.device`` to a torch device type (no index; see :func:`local_device`).

    ``auto`` picks cuda when available, else cpu (never npu: Ascend is opt-in).
    """
    if name not in DEVICE_NAMES:
        raise ConfigError(f"run.device must be one of {list(DEVICE_NAMES)}, got {name!r}.")
    if name == "auto":
        return torch.device("cuda" if accelerator("cuda").is_available() else HOST)
    if name != HOST and not accelerator(name).is_available():
        raise DistributedError(
            f"run.device={name} was requested but torch.{name}.is_available() is False."
        )
    return torch.device(name)


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of this process: ``cuda:<local_rank>`` / ``npu:<local_rank>``, or cpu.

    Also makes it the current device, so collectives and FSDP2 use it.
    """
    accel = accelerator(device)
    if accel.is_host:
        return torch.device(HOST)
    count = accel.device_count()
    if local_rank >= count:
        raise DistributedError(
            f"LOCAL_RANK={local_rank} needs at least {local_rank + 1} {device.type} devices on this node, "
            f"found {count}; launch at most {count} processes per node."
        )
    accel.set_device(local_rank)
    return torch.device(device.type, local_rank)


def resolve_backend(name: str, device_type: str) -> str:
    """Map ``parallel.backend`` to a process-group backend for ``device_type`` (cpu|cuda|npu).

    ``auto`` = gloo / nccl / hccl; gloo is accepted on every device.
    """
    if name not in BACKEND_NAMES:
        raise ConfigError(f"parallel.backend must be one of {list(BACKEND_NAMES)}, got {name!r}.")
    if name == "auto":
        return DEFAULT_BACKENDS[device_type]
    if name in ("nccl", "hccl") and DEFAULT_BACKENDS[device_type] != name:
        raise ConfigError(
            f"parallel.backend={name} does not run on device {device_type}; "
            f"use {DEFAULT_BACKENDS[device_type]!r} or 'gloo' (or 'auto')."
        )
    return name
