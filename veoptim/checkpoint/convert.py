"""A checkpoint version copied with its shards rewritten in DCP's own ``torch_save``
records, so torch's tools read it (``veoptim-export --format dcp``).

Every tensor is read through :func:`~veoptim.checkpoint.reader.read_checkpoint` (validated
as a load validates) and written back under the same keys and nesting; ``checkpoint.json``
and ``state/`` are copied as they are. The host holds every tensor, unsharded, meanwhile.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from veoptim.checkpoint import storage
from veoptim.checkpoint.component import DCP_DIR, read_info
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.checkpoint.reader import read_checkpoint
from veoptim.errors import CheckpointError


def _nested(flat: dict[str, torch.Tensor], metadata: Metadata, where: Path) -> dict[str, Any]:
    """The state dict as it was saved (``planner_data`` maps each flat key to its path)."""
    paths = metadata.planner_data or {key: (key,) for key in flat}
    out: dict[str, Any] = {}
    for key, tensor in flat.items():
        path = paths.get(key)
        if not path or not all(isinstance(part, str) for part in path):
            raise CheckpointError(f"DCP metadata {where} has no usable path for key {key!r}.")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = tensor
    return out


def copy_with_dcp_shards(version: Path, out_dir: Path) -> None:
    """Fill ``out_dir`` (an unpublished version directory) with ``version``'s checkpoint,
    its shards in DCP's ``torch_save`` layout; the caller's publisher flushes it."""
    info = read_info(version)
    read = read_checkpoint(version, {e.name: None for e in info.entries if e.tensors})
    flat = {
        f"{name}.{key}": t for name, tensors in read.tensors.items() for key, t in tensors.items()
    }
    for item in version.iterdir():
        if item.name in (MANIFEST_FILE, DCP_DIR):
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out_dir / item.name)
    writer = storage.tensor_writer(
        out_dir / DCP_DIR, storage_format=storage.FORMAT_DCP, fsync=False, threads=1
    )
    storage.save_tensors(_nested(flat, read.metadata, version / DCP_DIR), writer, local=True)
