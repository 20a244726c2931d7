"""Checkpoints in three layers (see docs/architecture.md and docs/checkpoints.md):

* ``component.py`` + ``checkpointer.py``: the component contract, the ``checkpoint.json``
  that records it, validation and inventories, and the ``Checkpointer`` (save, restore);
* ``versions.py`` + ``publish.py``: the versioned-directory store that checkpoints,
  exports and slots share (names, versions, manifests, readers; publication, retention
  and the fault phases);
* ``storage/``: the DCP storage behind them (raw format, reader, writer, prefault,
  read-ahead, durability), entered only through its package's functions.
"""

from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.versions import (
    Resolved,
    latest_complete,
    resolve,
    resolve_agreed,
    resolve_path,
    resolve_reference,
    resolve_version,
    step_name,
    validate_name,
)

__all__ = [
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
