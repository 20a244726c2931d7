"""Device abstraction: cpu, cuda and Ascend npu, and the process-group backend of each.

``torch_npu`` is imported only here and only when the device is ``npu``:
installing it on a host without CANN breaks ``import torch``, so it is an
optional extra and never a test dependency.
"""

from __future__ import annotations

import importlib

import torch

from veoptim.errors import ConfigError, DistributedError

DEVICE_NAMES = ("auto", "cpu", "cuda", "npu")
BACKEND_NAMES = ("auto", "gloo", "nccl", "hccl")
DEFAULT_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
NPU_MODULE = "torch_npu"


def _import_torch_npu() -> None:
    """Import torch_npu (registers ``torch.npu``) or say how to get it."""
    try:
        importlib.import_module(NPU_MODULE)
    except ImportError as exc:  # ModuleNotFoundError or a broken CANN install
        raise DistributedError(
            f"run.device=npu needs the optional package {NPU_MODULE} (Ascend CANN toolkit); "
            f"importing it failed: {exc}."
        ) from exc


def resolve_device(name: str) -> torch.device:
    """Map ``run.device`` to a torch device type (no index; see :func:`local_device`).

    ``auto`` picks cuda when available, else cpu (never npu: Ascend is opt-in).
    """
    if name not in DEVICE_NAMES:
        raise ConfigError(f"run.device must be one of {list(DEVICE_NAMES)}, got {name!r}.")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DistributedError(
            "run.device=cuda was requested but torch.cuda.is_available() is False."
        )
    if name == "npu":
        _import_torch_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DistributedError(
                "run.device=npu was requested but torch.npu.is_available() is False."
            )
    return torch.device(name)


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of this process: ``cuda:<local_rank>`` / ``npu:<local_rank>``, or cpu.

    Also makes it the current device, so collectives and FSDP2 use it.
    """
    if device.type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device.type)
    count = module.device_count()
    if local_rank >= count:
        raise DistributedError(
            f"LOCAL_RANK={local_rank} needs at least {local_rank + 1} {device.type} devices on this node, "
            f"found {count}; launch at most {count} processes per node."
        )
    module.set_device(local_rank)
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
