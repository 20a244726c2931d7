"""DCP I/O that never executes a pickle from a checkpoint.

Stock DCP unpickles ``.metadata`` with ``pickle.load`` and loads non-tensor
("bytes") entries with ``torch.load(weights_only=False)``: a crafted checkpoint
could run code. veoptim stores only tensors in DCP (every non-tensor value is
JSON next to it), reads ``.metadata`` with an allow-list unpickler that can
only rebuild DCP's own metadata classes, and refuses bytes entries.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from veoptim.checkpoint.storage.raw_format import DTYPES, RawChunk, check_storage
from veoptim.checkpoint.storage.raw_reader import read_raw_items
from veoptim.errors import CheckpointError

#: (module, name) pairs the metadata unpickler may resolve; everything else is refused.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {(RawChunk.__module__, RawChunk.__name__)}
    | {("torch", name) for name in ("Size", "strided", *DTYPES)}  # dtypes are plain values
    | {("torch._utils", "_get_layout")}
    | {("torch.serialization", "_get_layout")}
    | {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}
    | {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
)

#: Where a class of the metadata lived in earlier releases -> where it is now: checkpoints
#: written before the storage moved into ``veoptim.checkpoint.storage`` name the old module.
MOVED_GLOBALS: dict[tuple[str, str], tuple[str, str]] = {
    ("veoptim.checkpoint.raw_format", RawChunk.__name__): (RawChunk.__module__, RawChunk.__name__)
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        module, name = MOVED_GLOBALS.get((module, name), (module, name))
        if (module, name) not in ALLOWED_GLOBALS:
            raise CheckpointError(
                f"DCP metadata {self.source} references {module}.{name}, which is not a DCP "
                "metadata type; refusing to unpickle it (the file is corrupt or malicious)."
            )
        return super().find_class(module, name)


def read_dcp_metadata(dcp_dir: Path) -> Metadata:
    """Read ``<dcp_dir>/.metadata`` safely; any problem is a CheckpointError naming the file."""
    path = Path(dcp_dir) / ".metadata"
    try:
        metadata = _MetadataUnpickler(path.read_bytes(), path).load()
    except CheckpointError:
        raise
    except Exception as error:  # truncated / garbage bytes raise many exception types
        raise CheckpointError(f"DCP metadata {path} is unreadable: {error}.") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"DCP metadata {path} holds {type(metadata).__name__}, not Metadata.")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            raise CheckpointError(
                f"DCP checkpoint {dcp_dir} stores non-tensor entry {key!r} as a pickle; veoptim "
                "checkpoints keep non-tensor state in JSON and never unpickle it."
            )
    check_storage(metadata, Path(dcp_dir))
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose metadata comes from :func:`read_dcp_metadata`; reads both
    shard layouts: ``raw`` chunks into their destinations (``raw_reader.py``), DCP's own
    ``torch_save`` records as DCP does (weights-only ``torch.load``).

    ``metadata``: the checkpoint's metadata when the caller already read (and validated)
    it, so a load unpickles and checks ``.metadata`` once.
    """

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw = [i for i in plan.items if isinstance(self.storage_data[i.storage_index], RawChunk)]
        if raw:
            read_raw_items(Path(self.path), raw, self.storage_data, planner)
        if len(raw) == len(plan.items):
            done: Future[None] = Future()
            done.set_result(None)
            return done
        others = [
            i for i in plan.items if not isinstance(self.storage_data[i.storage_index], RawChunk)
        ]
        return super().read_data(dataclasses.replace(plan, items=others), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported by veoptim.")
        metadata = self._metadata or read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
