"""Retention and crash-debris cleanup, best-effort: failures are logged, never raised.

* ``prune_names`` unlinks the oldest prunable names beyond ``keep_last`` (a name counts only
  if it is the name its version was first published under; a second link made by hand is
  never pruned).
* ``collect_garbage`` removes temporary links and versions that no name points to. Entries
  in ``protected`` (saves in flight, the version a save just moved its name away from) and
  versions any name points to are never touched.

Deleting a version unlinks its manifest first, so a half-deleted version is never taken
for a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

from veoptim.checkpoint.faults import PHASE_RETENTION, FaultHook, fire
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
    fault_hook: FaultHook | None = None,
) -> list[Path]:
    """Remove unreferenced versions and stray temporary links; return what was removed.

    ``protected`` holds entry names (version ids, temporary link names) to keep.
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
    for entry in entries:
        if not is_version_id(entry) or entry in referenced or entry in protected:
            continue
        path = version_dir(root, entry)
        fire(fault_hook, PHASE_RETENTION)
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


def _prunable(root: Path, kind: str) -> list[tuple[tuple[int, int], str]]:
    out = []
    for name, version_id in published_names(root).items():
        try:
            manifest: Manifest = read_manifest(version_dir(root, version_id))
        except CheckpointError:
            continue
        if manifest.kind == kind and manifest.prunable and manifest.name == name:
            step = -1 if manifest.step is None else manifest.step
            out.append(((step, manifest.created_ns), name))
    return sorted(out)


def prune_names(
    root: Path,
    *,
    keep_last: int,
    kind: str,
    keep_name: str,
    fault_hook: FaultHook | None = None,
) -> list[str]:
    """Unlink the oldest prunable ``kind`` names beyond ``keep_last`` (never ``keep_name``).

    Only the names go; their versions, now unreferenced, go with ``collect_garbage``.
    """
    if keep_last <= 0:
        return []
    everything = _prunable(Path(root), kind)
    candidates = [name for _, name in everything if name != keep_name]
    excess = len(everything) - keep_last
    pruned: list[str] = []
    for name in candidates[: max(excess, 0)]:
        fire(fault_hook, PHASE_RETENTION)
        try:
            (Path(root) / name).unlink()
        except OSError as exc:
            log.warning("Checkpoint retention could not unlink %s (ignored): %s", name, exc)
            continue
        pruned.append(name)
    return pruned
