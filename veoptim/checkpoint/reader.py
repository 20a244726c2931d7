"""Reading a checkpoint without applying it (``Checkpointer.read``): the one tensor reader
of checkpoints outside a load, for offline exports and anything else that needs the saved
tensors or JSON themselves rather than live objects restored from them.

Everything is checked before the first tensor is read, as a load checks it: the
``checkpoint.json`` format and component list, the DCP metadata (allow-list unpickler),
each requested component's saved JSON, and each requested tensor inventory against the
saved one. A failure is one ``CheckpointError``, and nothing is returned.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from veoptim.checkpoint import storage
from veoptim.checkpoint.component import (
    DCP_DIR,
    INFO_FILE,
    JSON_PER_RANK,
    JSON_SHARED,
    CheckpointInfo,
    Inventory,
    check_components,
    compare_inventory,
    rank_json_path,
    read_info,
    read_json,
    saved_inventory,
    shared_json_path,
)
from veoptim.errors import CheckpointError


@dataclass(frozen=True)
class CheckpointRead:
    """What :func:`read_checkpoint` read from one version (fresh objects: the caller owns
    the only references)."""

    path: Path
    info: CheckpointInfo
    #: Every component's saved tensor inventory (keys without ``<component>.``).
    saved: dict[str, Inventory]
    #: The requested components' JSON (a per-rank component's: ``rank``'s).
    json: dict[str, Any]
    #: The requested components' tensors, exactly the requested inventories.
    tensors: dict[str, dict[str, torch.Tensor]]
    #: The version's DCP metadata (checked).
    metadata: Metadata


def read_checkpoint(
    path: Path,
    tensors: Mapping[str, Inventory | None] | None = None,
    *,
    json: Collection[str] = (),
    needs: Collection[str] = (),
    rank: int = 0,
) -> CheckpointRead:
    """Validate the resolved version ``path`` and read, into fresh CPU buffers, the tensors
    of each component in ``tensors`` (its expected inventory, compared with the saved one
    first; None: whatever it saved) and the JSON of each component in ``json``; this
    process alone. ``needs``: components that must be saved, though nothing of them is read. Raises ``CheckpointError`` before reading a tensor if anything does not
    match."""
    tensors = dict(tensors or {})
    info = read_info(path)
    entries = {entry.name: entry for entry in info.entries}
    check_components(entries, {*needs, *tensors, *json}, path, exact=False)
    dcp_dir = path / DCP_DIR
    metadata = storage.read_metadata(dcp_dir)
    saved = {name: saved_inventory(metadata, name, dcp_dir) for name in entries}
    expected = {}
    for name, wanted in tensors.items():
        expected[name] = saved[name] if wanted is None else wanted
        compare_inventory(expected[name], saved[name], dcp_dir)
    loaded_json = {name: _saved_json(path, entries[name].json, name, info, rank) for name in json}
    buffers = {
        name: {key: torch.empty(spec.shape, dtype=spec.dtype) for key, spec in inventory.items()}
        for name, inventory in expected.items()
    }
    if any(buffers.values()):
        storage.load_tensors(
            {name: b for name, b in buffers.items() if b}, dcp_dir, metadata, local=True
        )
    return CheckpointRead(path, info, saved, loaded_json, buffers, metadata)


def _saved_json(path: Path, scope: str | None, name: str, info: CheckpointInfo, rank: int) -> Any:
    if scope == JSON_SHARED:
        return read_json(shared_json_path(path, name))
    if scope == JSON_PER_RANK:
        return read_json(rank_json_path(path, name, rank)) if rank < info.world_size else None
    if scope is not None:
        raise CheckpointError(f"{path / INFO_FILE}: component {name!r} has JSON scope {scope!r}.")
    return None
