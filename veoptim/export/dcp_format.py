"""``veoptim-export --format dcp``: a training checkpoint rewritten in DCP's own shard layout.

veoptim writes its shards in the ``raw`` layout by default (``checkpoint.format``), which
only veoptim reads. This writer produces a copy of the whole checkpoint (every component:
``checkpoint.json``, ``state/``, and ``dcp/`` with the same keys and nesting) whose shards
are DCP's ``torch_save`` records, so torch's own tools read it
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``) and veoptim resumes from
it like from the original. The tensors are copied exactly (``--dtype`` does not apply);
the host holds every tensor of the checkpoint, unsharded, while it converts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from veoptim.checkpoint import component as C
from veoptim.checkpoint import storage
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import read_info
from veoptim.checkpoint.layout import MANIFEST_FILE
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


def write_dcp(source: Any, out_dir: Path, options: Any) -> None:
    """Copy ``source``'s checkpoint (a ``CheckpointSource``) into ``out_dir`` with DCP
    ``torch_save`` shards. The registry's one checkpoint-copying entry: it copies a
    checkpoint, not a model, so it gets the checkpoint rather than a ``ModelState`` and has
    no live export."""
    reader = Checkpointer(source.version.parent, fsync=False)
    info = read_info(source.version)
    read = reader.read(source.version, {e.name: None for e in info.entries if e.tensors})
    flat = {
        f"{name}.{key}": t for name, tensors in read.tensors.items() for key, t in tensors.items()
    }
    for item in source.version.iterdir():
        if item.name in (MANIFEST_FILE, C.DCP_DIR):
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, out_dir / item.name)
    writer = storage.tensor_writer(  # DCP's own records; the publisher flushes
        out_dir / C.DCP_DIR, storage_format=storage.FORMAT_DCP, fsync=False, threads=1
    )
    dcp_dir = source.version / C.DCP_DIR
    storage.save_tensors(_nested(flat, read.metadata, dcp_dir), writer, local=True)
