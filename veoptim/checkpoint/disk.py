"""A checkpoint root's files: the version store's storage seam, and what removes things.

``StoreFiles`` (a ``typing.Protocol``, like torchtitan's ``CheckpointStorage``) is every
change the version store makes to a root: create a directory, write a file, flush files
and directories (durability), create a symlink, replace a name with it, list, unlink,
remove a tree. ``LocalFiles`` is the local filesystem's, the one place of ``os.replace``
and ``os.symlink`` outside the DCP storage, and its one caller of the storage's
durability (``storage.fsync_*``). Publication (``publish.py``) and retention here go
through it; tests pass a recording or failing one, and ``faults.with_faults`` wraps one
to inject faults at the named phases it is told of (``reached``).

Retention and crash-debris cleanup are best-effort: failures are logged, never raised.

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
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Protocol

from veoptim.checkpoint import storage
from veoptim.checkpoint.faults import PHASE_AFTER_REPLACE, PHASE_BEFORE_REPLACE, PHASE_RETENTION
from veoptim.checkpoint.layout import (
    Manifest,
    is_temp_link_name,
    is_version_id,
    link_path,
    link_target,
    manifest_path,
    published_names,
    read_link,
    read_manifest,
    temp_link_path,
    version_dir,
    versions_dir,
)
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the storage seam
class StoreFiles(Protocol):
    """The filesystem operations of a version store (paths are absolute or root-relative
    as the caller built them; errors are ``OSError``)."""

    def make_dir(self, path: Path) -> None: ...  # parents too; an existing one is fine
    def write(self, path: Path, data: bytes) -> None: ...  # parents created; not flushed
    def flush(self, files: Sequence[Path] = (), dirs: Sequence[Path | str] = ()) -> None: ...
    def flush_tree(self, path: Path) -> None: ...  # every file under ``path``
    def symlink(self, target: str, path: Path) -> None: ...
    def replace(self, source: Path, destination: Path) -> None: ...  # atomic
    def list(self, path: Path) -> list[str]: ...
    def unlink(self, path: Path) -> None: ...
    def remove_tree(self, path: Path) -> None: ...
    def reached(self, phase: str) -> None: ...  # a named point (faults.py); no disk change


class LocalFiles:
    """The local filesystem (:class:`StoreFiles`); ``fsync``: whether :meth:`flush` and
    :meth:`flush_tree` make files and directories durable (off: they do nothing)."""

    def __init__(self, *, fsync: bool = True) -> None:
        self.fsync = fsync

    def make_dir(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def write(self, path: Path, data: bytes) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)

    def flush(self, files: Sequence[Path] = (), dirs: Sequence[Path | str] = ()) -> None:
        if self.fsync and (files or dirs):  # one concurrent batch: the device flushes merge
            storage.fsync_all(files=list(files), dirs=list(dirs))

    def flush_tree(self, path: Path) -> None:
        if self.fsync:
            storage.fsync_tree(path, files=True, dirs=False)

    def symlink(self, target: str, path: Path) -> None:
        os.symlink(target, path)

    def replace(self, source: Path, destination: Path) -> None:
        os.replace(source, destination)

    def list(self, path: Path) -> list[str]:
        return os.listdir(path)

    def unlink(self, path: Path) -> None:
        Path(path).unlink()

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path)

    def reached(self, phase: str) -> None:
        """Nothing to do on disk."""


LOCAL = LocalFiles(fsync=False)  # removal needs no flush: a half-removed version is incomplete


# ---------------------------------------------------------------- pointing a name
def refuse_legacy(link: Path) -> None:
    """A plain directory under a name (e.g. a checkpoint copied with ``cp -r``, which turns
    the link into a directory) may be the only copy of that checkpoint: never replace it."""
    if os.path.lexists(link) and not link.is_symlink():
        raise CheckpointError(
            f"Checkpoint name {link.name!r} in {link.parent} is a plain directory (a legacy "
            f"checkpoint, or one copied without its symlinks) and is never overwritten; it "
            f"stays readable, save under a new name."
        )


def point_name(files: StoreFiles, root: Path, name: str, version_id: str, key: str) -> str | None:
    """Atomically point ``name`` at ``version_id`` (a temporary relative link replaced over
    it, then the root flushed); return the version id it pointed to before. Rolled back
    to that version if anything fails after the replace. ``key``: the root's in-flight
    registry key (the temporary link is protected from cleanup while it exists)."""
    link = link_path(root, name)
    refuse_legacy(link)  # a directory may have appeared since prepare
    try:
        previous = read_link(root, name)
    except CheckpointError:
        previous = None  # a malformed link is replaced like any other
    tmp = temp_link_path(root, name, uuid.uuid4().hex[:16])
    register(key, tmp.name)
    try:
        files.symlink(link_target(version_id), tmp)
        files.reached(PHASE_BEFORE_REPLACE)
        files.replace(tmp, link)
    except BaseException:
        with suppress(OSError):
            files.unlink(tmp)
        raise
    finally:
        unregister(key, tmp.name)
    try:
        files.reached(PHASE_AFTER_REPLACE)
        files.flush(dirs=[root])
    except BaseException as exc:
        _roll_back(files, root, name, previous, exc)
        raise
    return previous


def _roll_back(
    files: StoreFiles, root: Path, name: str, previous: str | None, cause: BaseException
) -> None:
    link = link_path(root, name)
    try:
        if previous is None:
            files.unlink(link)
        else:
            tmp = temp_link_path(root, name, uuid.uuid4().hex[:16])
            files.symlink(link_target(previous), tmp)
            files.replace(tmp, link)
    except OSError as exc:
        msg = "Rolling %s back after %r failed (%s); it points to the new version."
        log.error(msg, link, cause, exc)


# ---------------------------------------------------------------- removal
def remove_version(version: Path, files: StoreFiles = LOCAL) -> None:
    """Delete a version: manifest first (it stops being complete), then the rest."""
    with suppress(FileNotFoundError):
        files.unlink(manifest_path(version))
    files.remove_tree(version)


def remove_root(root: Path, files: StoreFiles = LOCAL) -> None:
    """Delete a checkpoint root and every version in it: all manifests first (no reader
    takes a half-deleted version for a complete one), then each version, then the rest
    (names, debris). Nothing there: nothing to do."""
    root = Path(root)
    try:
        versions = sorted(e for e in files.list(versions_dir(root)) if is_version_id(e))
    except FileNotFoundError:
        versions = []
    for entry in versions:
        with suppress(FileNotFoundError):
            files.unlink(manifest_path(version_dir(root, entry)))
    for entry in versions:
        with suppress(FileNotFoundError):
            files.remove_tree(version_dir(root, entry))
    with suppress(FileNotFoundError):
        files.remove_tree(root)


def unpublish(root: Path, name: str, files: StoreFiles = LOCAL) -> bool:
    """Delete published name ``name`` of ``root`` and the version it points to (manifest
    first, then the name, then the files); False when ``name`` is not published there."""
    version_id = read_link(Path(root), name)
    if version_id is None:
        return False
    version = version_dir(Path(root), version_id)
    with suppress(FileNotFoundError):
        files.unlink(manifest_path(version))
    with suppress(FileNotFoundError):
        files.unlink(link_path(Path(root), name))
    with suppress(FileNotFoundError):
        files.remove_tree(version)
    return True


# ---------------------------------------------------------------- retention and cleanup (best-effort)
def collect_garbage(
    root: Path, *, protected: Collection[str] = (), files: StoreFiles = LOCAL
) -> list[Path]:
    """Remove unreferenced versions and stray temporary links; return what was removed.

    ``protected`` holds entry names (version ids, temporary link names) to keep.
    """
    root = Path(root)
    removed: list[Path] = []
    try:
        for entry in files.list(root):
            if is_temp_link_name(entry) and entry not in protected:
                _best_effort(lambda p=root / entry: files.unlink(p), root / entry, removed)
    except OSError as exc:
        log.warning("Checkpoint cleanup could not list %s: %s", root, exc)
        return removed
    referenced = set(published_names(root).values())
    try:
        entries = sorted(files.list(versions_dir(root)))
    except OSError:
        return removed
    for entry in entries:
        if not is_version_id(entry) or entry in referenced or entry in protected:
            continue
        path = version_dir(root, entry)
        files.reached(PHASE_RETENTION)
        _best_effort(lambda p=path: remove_version(p, files), path, removed)
    return removed


def _best_effort(action: Callable[[], None], path: Path, removed: list[Path]) -> None:
    try:
        action()
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("Checkpoint cleanup could not remove %s (ignored): %s", path, exc)


def _prunable(root: Path, kind: str, run: str | None) -> list[tuple[tuple[int, int], str]]:
    out = []
    for name, version_id in published_names(root).items():
        try:
            manifest: Manifest = read_manifest(version_dir(root, version_id))
        except CheckpointError:
            continue
        if run is not None and manifest.run != run:
            continue  # another run's name (kept after checkpoint.overwrite): never pruned
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
    run: str | None = None,
    files: StoreFiles = LOCAL,
) -> list[str]:
    """Unlink the oldest prunable ``kind`` names beyond ``keep_last`` (never ``keep_name``);
    with ``run``, only that run's names count and go.

    Only the names go; their versions, now unreferenced, go with ``collect_garbage``.
    """
    if keep_last <= 0:
        return []
    everything = _prunable(Path(root), kind, run)
    candidates = [name for _, name in everything if name != keep_name]
    excess = len(everything) - keep_last
    pruned: list[str] = []
    for name in candidates[: max(excess, 0)]:
        files.reached(PHASE_RETENTION)
        try:
            files.unlink(Path(root) / name)
        except OSError as exc:
            log.warning("Checkpoint retention could not unlink %s (ignored): %s", name, exc)
            continue
        pruned.append(name)
    return pruned


# ---------------------------------------------------------------- saves in flight in this process
# The entries (version ids, temporary link names) of saves in flight in this process.
#
# Keyed by the real path of their checkpoint root, so cleanup run by another ``Publisher``
# on the same root (however its path is spelled) never deletes what a save is still
# writing.
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
