"""A LoRA run's model state: the adapters only, plus a fingerprint of the frozen base.

The base is not saved with every checkpoint (it does not change); instead the
checkpoint records what it was: for a model loaded from ``model.path`` its config and
a hash of its weight index (the safetensors headers or index file: names, shapes,
dtypes and offsets), for a model built from config that config and its init seed.
A resume against another base fails closed before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from veoptim.checkpoint.component import ComponentState, SavedComponent, Staged
from veoptim.errors import CheckpointError
from veoptim.state.model import copy_installer, module_inventory

BASE = "base"
ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True)
#: Config fields that say nothing about the weights (they change with library versions).
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "architectures", "dtype")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _weight_index(path: Path) -> str:
    """Hash of the weight files' index: ``*.index.json`` files, else every safetensors
    header (tensor names, dtypes, shapes, offsets), without reading the weights."""
    digest = hashlib.sha256()
    indexes = sorted(path.glob("*.index.json"))
    files = indexes or sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no safetensors weights to fingerprint.")
    for file in files:
        digest.update(file.name.encode())
        if file.suffix == ".json":
            digest.update(file.read_bytes())
            continue
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(length))
    return digest.hexdigest()


def base_fingerprint(model_config: Any, model_path: str, init_seed: int) -> dict[str, Any]:
    """What identifies the frozen base (JSON): its config, and its weights' index or seed."""
    config = {k: v for k, v in model_config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    source = (
        {"weight_index": _weight_index(Path(model_path))}
        if model_path
        else {"init_seed": init_seed}
    )
    return {"model_type": config.get("model_type"), "config": _digest(config), **source}


def fingerprint_differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The keys on which two base fingerprints differ."""
    a, b = a or {}, b or {}
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_base(saved: SavedComponent, fingerprint: dict[str, Any]) -> None:
    """Refuse adapters saved on another base than ``fingerprint`` names (CheckpointError)."""
    found = saved.json.get(BASE) if isinstance(saved.json, dict) else None
    if found == fingerprint:
        return
    differs = fingerprint_differences(found, fingerprint)
    raise CheckpointError(
        f"the adapters in {saved.path} were trained on another base model ({', '.join(differs)} "
        f"differ{'s' if len(differs) == 1 else ''}: saved {found}, live {fingerprint}); "
        "load them on the base they were trained on (the same model.path or model config "
        "and model.init_seed)."
    )


class LoRAModelState:
    """The trainable (adapter) parameters of ``model``; ``fingerprint`` names its base."""

    def __init__(self, model: nn.Module, fingerprint: dict[str, Any]) -> None:
        self.model, self.fingerprint = model, fingerprint

    def state(self) -> ComponentState:
        return ComponentState(
            tensors=get_model_state_dict(self.model, options=ADAPTERS_ONLY),
            json={BASE: self.fingerprint},
        )

    def stage(self, saved: SavedComponent) -> Staged:
        check_base(saved, self.fingerprint)
        live = get_model_state_dict(self.model, options=ADAPTERS_ONLY)
        buffers = {fqn: torch.empty_like(t) for fqn, t in live.items()}

        def install_through_dcp() -> None:
            set_model_state_dict(self.model, buffers, options=StateDictOptions(strict=False))

        install = copy_installer(self.model, live, buffers) or install_through_dcp
        return Staged(expected=module_inventory(live), buffers=buffers, install=install)
