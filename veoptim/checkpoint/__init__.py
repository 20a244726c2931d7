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

The door: ``Checkpointer`` (save, resolve, restore, load, read), what it answers
(``CheckpointDescription``, ``CheckpointRead``), the component contract it takes
(``StateComponent``, ``ComponentState``, ``SavedComponent``, ``Staged``, ``TensorSpec``)
and the reader of what a version holds (``read_info``, a ``CheckpointInfo``). Those need
torch and are imported on first use (PEP 562), so the versioned store's publication and
readers below still start without torch.
"""

from veoptim.checkpoint.layout import step_name, validate_name
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.versions import (
    Resolved,
    latest_complete,
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
    "SavedComponent": "component",
    "Staged": "component",
    "StateComponent": "component",
    "TensorSpec": "component",
    "read_info": "component",
}

__all__ = [
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
