"""Retention and crash-debris cleanup, best-effort: failures are logged, never raised.

* ``prune_names`` unlinks the oldest prunable names beyond ``keep_last`` (a name counts if
  it is the name its version was first published under; aliases are never pruned).
* ``collect_garbage`` removes temporary links and versions that no name points to:
  incomplete ones (a crashed save) at once, complete ones once they have been retired for
  ``grace_s`` seconds. A version's retirement time is its directory's mtime, which the
  publisher touches when a name stops pointing to it. Versions in ``protected`` (saves in
  flight in this process) and versions any name points to are never touched.

Deleting a version unlinks its manifest first, so a half-deleted version is never taken
for a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from veoptim.checkpoint.layout import (
    is_temp_link_name,
    is_version_id,
    manifest_path,
    version_dir,
    versions_dir,
)
from veoptim.checkpoint.manifest import Manifest, read_manifest
from veoptim.checkpoint.resolve import published_names
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)

PHASE_RETENTION = "retention"
FaultHook = Callable[[str], None]

# Entries (version ids, temporary link names) of saves in flight in this process, per
# real root path: cleanup by another Publisher on the same root must not delete them.
_IN_FLIGHT: dict[str, set[str]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def _root_key(root: Path) -> str:
    return str(Path(root).resolve())


def register_in_flight(root: Path, entry: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.setdefault(_root_key(root), set()).add(entry)


def unregister_in_flight(root: Path, entry: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.get(_root_key(root), set()).discard(entry)


def in_flight(root: Path) -> frozenset[str]:
    with _IN_FLIGHT_LOCK:
        return frozenset(_IN_FLIGHT.get(_root_key(root), ()))


def retire(version: Path) -> None:
    """Record now as the time ``version`` stopped being pointed to (its dir mtime)."""
    try:
        os.utime(version)
    except OSError as exc:
        log.warning("Could not mark retired checkpoint version %s: %s", version, exc)


def remove_version(version: Path) -> None:
    """Delete a version: manifest first (it stops being complete), then the rest."""
    try:
        manifest_path(version).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(version)


def collect_garbage(
    root: Path,
    *,
    protected: Collection[str] = (),
    grace_s: float = 0.0,
    fault_hook: FaultHook | None = None,
) -> list[Path]:
    """Remove unreferenced versions and stray temporary links; return what was removed.

    ``protected`` holds entry names (version ids, temporary link names) of saves in flight.
    """
    root = Path(root)
    removed: list[Path] = []
    try:
        for entry in os.listdir(root):
            if is_temp_link_name(entry) and entry not in protected:
                _best_effort((root / entry).unlink, root / entry, removed)
    except OSError as exc:
        log.warning("Checkpoint cleanup could not list %s: %s", root, exc)
        return removed
    referenced = set(published_names(root).values())
    try:
        entries = sorted(os.listdir(versions_dir(root)))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not is_version_id(entry) or entry in referenced or entry in protected:
            continue
        path = version_dir(root, entry)
        try:
            complete = manifest_path(path).exists()
            if complete and now - path.stat().st_mtime < grace_s:
                continue
        except OSError:
            continue
        if fault_hook is not None:
            fault_hook(PHASE_RETENTION)
        _best_effort(lambda p=path: remove_version(p), path, removed)
    return removed


def _best_effort(action: Callable[[], None], path: Path, removed: list[Path]) -> None:
    try:
        action()
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("Checkpoint cleanup could not remove %s (ignored): %s", path, exc)


def _prunable(root: Path, kind: str) -> list[tuple[tuple[int, int], str, Path]]:
    out = []
    for name, version_id in published_names(root).items():
        path = version_dir(root, version_id)
        try:
            manifest: Manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest.kind == kind and manifest.prunable and manifest.name == name:
            step = -1 if manifest.step is None else manifest.step
            out.append(((step, manifest.created_ns), name, path))
    return sorted(out)


def prune_names(
    root: Path,
    *,
    keep_last: int,
    kind: str,
    keep_name: str,
    fault_hook: FaultHook | None = None,
) -> list[str]:
    """Unlink the oldest prunable ``kind`` names beyond ``keep_last`` (never ``keep_name``)."""
    if keep_last <= 0:
        return []
    everything = _prunable(Path(root), kind)
    candidates = [c for c in everything if c[1] != keep_name]
    excess = len(everything) - keep_last
    pruned: list[str] = []
    for _, name, path in candidates[: max(excess, 0)]:
        if fault_hook is not None:
            fault_hook(PHASE_RETENTION)
        try:
            (Path(root) / name).unlink()
        except OSError as exc:
            log.warning("Checkpoint retention could not unlink %s (ignored): %s", name, exc)
            continue
        retire(path)
        pruned.append(name)
    return pruned
