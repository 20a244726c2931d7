"""The expected tensor inventory of a checkpoint, derived from the live model and optimizer.

Validation compares this inventory (not whatever happens to be in the file)
with the DCP metadata: every expected key present, nothing unexpected, every
global shape and dtype equal. Nothing is read or written besides metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from veoptim.checkpoint.format import MODEL_PREFIX, OPTIMIZER_PREFIX
from veoptim.errors import CheckpointError
from veoptim.optim.state_check import expected_optimizer_state

MAX_LISTED = 8


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


Inventory = dict[str, TensorSpec]


def trainable_named_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """(fqn, param) of every parameter the optimizer holds, in model order."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in model.named_parameters() if id(p) in held]


def model_inventory(model_state: dict[str, torch.Tensor]) -> Inventory:
    """Specs of ``model.<fqn>`` keys from a (sharded) model state dict."""
    return {
        f"{MODEL_PREFIX}.{fqn}": TensorSpec(tuple(t.shape), t.dtype)
        for fqn, t in model_state.items()
        if isinstance(t, torch.Tensor)
    }


def optimizer_inventory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Inventory:
    """Specs of ``optimizer.<fqn>.<key>`` keys for the optimizer's full parameter inventory.

    The optimizer reports local shapes; a state tensor with the parameter's local
    shape is sharded like the parameter, so its global shape is the parameter's.
    """
    inventory: Inventory = {}
    for fqn, param in trainable_named_params(model, optimizer):
        local_shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        for key, (shape, dtype) in expected_optimizer_state(optimizer, param).items():
            global_shape = param.shape if tuple(shape) == tuple(local_shape) else shape
            inventory[f"{OPTIMIZER_PREFIX}.{fqn}.{key}"] = TensorSpec(tuple(global_shape), dtype)
    return inventory


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def compare_inventory(
    expected: Inventory, metadata: Metadata, prefixes: tuple[str, ...], where: Path
) -> None:
    """Raise one CheckpointError listing every missing, unexpected or mismatched tensor."""
    saved: dict[str, TensorSpec] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(tuple(p + "." for p in prefixes)):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {where} stores {key!r} as non-tensor data.")
        saved[key] = TensorSpec(tuple(entry.size), entry.properties.dtype)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [
        f"{key} (expected {expected[key]}, found {saved[key]})"
        for key in sorted(set(expected) & set(saved))
        if expected[key] != saved[key]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_listed(unexpected)}")
    if mismatched:
        problems.append(
            f"{len(mismatched)} tensor(s) with another shape/dtype: {_listed(mismatched)}"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {where} does not match the live run: " + "; ".join(problems) + "."
        )
