"""RNG states (Python, NumPy, torch CPU and device) as JSON, so nothing is unpickled on load.

The device state (cuda or Ascend npu) is read and written through the device's
:class:`~veoptim.distributed.device.Accelerator`; the host has none.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from veoptim.checkpoint import ComponentState, SavedComponent, Staged
from veoptim.distributed.device import accelerator
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)

RNG_KEYS = ("python", "numpy", "torch_cpu", "device")


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as JSON-ready values."""
    version, mt_state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    device_state = accelerator(device).get_rng_state(device)
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": np_state,
        "torch_cpu": torch.get_rng_state().tolist(),
        "device": None if device_state is None else device_state.tolist(),
    }


def check_rng(state: Any, where: str) -> None:
    """Raise CheckpointError unless ``state`` has the shape ``capture_rng`` produces."""
    if not isinstance(state, dict) or set(state) != set(RNG_KEYS):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"RNG state in {where} must have keys {list(RNG_KEYS)}, found {found}."
        )


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Install RNG states captured by :func:`capture_rng` (validated with :func:`check_rng`)."""
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_state = dict(state["numpy"])
    np_state["state"] = dict(np_state["state"])
    np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    if state["device"] is not None:
        accelerator(device).set_rng_state(torch.tensor(state["device"], dtype=torch.uint8), device)


class RNGState:
    """This rank's RNG states. Restored only on the world size they were saved on: with
    another rank count the ranks' streams cannot be matched up, so they are left as
    they are (with a warning)."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device, self.world_size = device, world_size

    def state(self) -> ComponentState:
        return ComponentState(json=capture_rng(self.device), json_per_rank=True)

    def stage(self, saved: SavedComponent) -> Staged:
        saved_world = saved.world_size
        if saved_world != self.world_size:
            log.warning(
                "RNG states are not restored: %s was saved on %s ranks, this run has %d "
                "(weights, optimizer, LR and data order are; random ops such as dropout "
                "draw other numbers than the uninterrupted run).",
                saved.path, saved_world, self.world_size,
            )  # fmt: skip
            return Staged()
        check_rng(saved.json, f"{saved.name} state in {saved.path}")
        return Staged(install=lambda: restore_rng(saved.json, self.device))
