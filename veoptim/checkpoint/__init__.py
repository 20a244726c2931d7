"""Checkpoints in three layers (see docs/architecture.md and docs/checkpoints.md):

* ``component.py`` + ``checkpointer.py`` (+ ``reader.py``): the component contract, the
  ``checkpoint.json`` that records it, validation and inventories, and the
  ``Checkpointer`` (save, resolve, restore, load, read);
* the versioned-directory store that checkpoints, exports and slots share: the root on
  disk (``layout.py``: names, versions, manifests), its readers (``versions.py``),
  publication (``publish.py``) through the storage seam with retention (``disk.py``),
  and ``faults.py`` naming the points where tests inject faults;
* ``storage/``: the DCP storage behind them (raw format, reader, writer, prefault,
  read-ahead, durability), entered only through its package's functions.

This package is the door: no module outside it imports one of its modules
(``tests/test_import_rules.py``). It exports ``Checkpointer`` (save, resolve, restore,
load, read), what it answers (``CheckpointDescription``, ``CheckpointRead``), the
component contract it takes (``StateComponent``, ``ComponentState``, ``SavedComponent``,
``Staged``, ``TensorSpec``, ``Inventory``), the reader of what a version holds
(``read_info``, a ``CheckpointInfo``) and the DCP-shard copy of a version
(``copy_with_dcp_shards``); those need torch and are imported on first use (PEP 562), so
the versioned store's names, publication, readers and retention, exported below, still
start without torch.
"""

from veoptim.checkpoint.disk import collect_garbage, remove_root, unpublish
from veoptim.checkpoint.faults import FaultHook
from veoptim.checkpoint.layout import (
    KIND_CHECKPOINT,
    MANIFEST_FILE,
    VERSIONS_DIR,
    manifest_path,
    published_names,
    read_link,
    step_name,
    validate_name,
)
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.versions import (
    Resolved,
    is_within,
    latest_complete,
    locate_path,
    newest_complete,
    resolve,
    resolve_agreed,
    resolve_path,
    resolve_reference,
    resolve_version,
)
from veoptim.lazy import lazy_names

#: Public name -> submodule that defines it (imported on first use: they import torch).
_EXPORTS: dict[str, str] = {
    "Checkpointer": "checkpointer",
    "CheckpointDescription": "checkpointer",
    "CheckpointRead": "reader",
    "CheckpointInfo": "component",
    "ComponentState": "component",
    "DCP_DIR": "component",
    "INFO_FILE": "component",
    "Inventory": "component",
    "SavedComponent": "component",
    "Staged": "component",
    "StateComponent": "component",
    "TensorSpec": "component",
    "check_component_name": "component",
    "read_info": "component",
    "read_json": "component",
    "shared_json_path": "component",
    "copy_with_dcp_shards": "convert",
}

__all__ = [
    "DCP_DIR",
    "INFO_FILE",
    "KIND_CHECKPOINT",
    "MANIFEST_FILE",
    "VERSIONS_DIR",
    "FaultHook",
    "Inventory",
    "check_component_name",
    "collect_garbage",
    "copy_with_dcp_shards",
    "is_within",
    "locate_path",
    "manifest_path",
    "newest_complete",
    "published_names",
    "read_json",
    "read_link",
    "remove_root",
    "shared_json_path",
    "unpublish",
    "CheckpointDescription",
    "CheckpointInfo",
    "CheckpointRead",
    "Checkpointer",
    "ComponentState",
    "SavedComponent",
    "Staged",
    "StateComponent",
    "TensorSpec",
    "read_info",
    "PendingVersion",
    "Published",
    "Publisher",
    "Resolved",
    "latest_complete",
    "resolve",
    "resolve_agreed",
    "resolve_path",
    "resolve_reference",
    "resolve_version",
    "step_name",
    "validate_name",
]

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
