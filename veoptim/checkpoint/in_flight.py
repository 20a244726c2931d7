"""The entries (version ids, temporary link names) of saves in flight in this process.

Keyed by the real path of their checkpoint root, so cleanup run by another ``Publisher``
on the same root (however its path is spelled) never deletes what a save is still
writing.
"""

from __future__ import annotations

import threading
from pathlib import Path

_ENTRIES: dict[str, set[str]] = {}
_LOCK = threading.Lock()


def root_key(root: Path) -> str:
    """The registry's key for ``root``: its real path (resolve once per save: each resolve
    is a walk of ``lstat`` calls)."""
    return str(Path(root).resolve())


def register(key: str, entry: str) -> None:
    with _LOCK:
        _ENTRIES.setdefault(key, set()).add(entry)


def unregister(key: str, entry: str) -> None:
    with _LOCK:
        _ENTRIES.get(key, set()).discard(entry)


def in_flight(key: str) -> set[str]:
    """A copy of the entries in flight under the root ``key``."""
    with _LOCK:
        return set(_ENTRIES.get(key, ()))
