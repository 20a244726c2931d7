"""Compare the tensor inventory a load expects with a checkpoint's DCP metadata.

The expected inventory comes from the live components (not from whatever happens
to be in the file): every expected key present, nothing unexpected, every global
shape and dtype equal. Nothing is read or written besides metadata.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from veoptim.checkpoint.component import Inventory, TensorSpec
from veoptim.errors import CheckpointError

MAX_LISTED = 8


def saved_inventory(metadata: Metadata, prefix: str, where: Path) -> Inventory:
    """Specs of the tensors stored under ``<prefix>.`` (keys without the prefix)."""
    saved: Inventory = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(prefix + "."):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {where} stores {key!r} as non-tensor data.")
        saved[key[len(prefix) + 1 :]] = TensorSpec(tuple(entry.size), entry.properties.dtype)
    return saved


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def compare_inventory(expected: Inventory, saved: Inventory, where: Path) -> None:
    """Raise one CheckpointError listing every missing, unexpected or mismatched tensor."""
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


def prefixed(prefix: str, inventory: Inventory) -> Inventory:
    """``inventory`` with every key under ``<prefix>.`` (how DCP names nested keys)."""
    return {f"{prefix}.{key}": spec for key, spec in inventory.items()}
