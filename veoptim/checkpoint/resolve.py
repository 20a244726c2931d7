"""Readers: resolve a name once to a complete, immutable version directory inside the root.

A reader must read every file from the directory ``resolve`` returns, never through the
name again: a concurrent save may re-point the name, but the returned version stays as it
is (see ``docs/checkpoints.md`` for how long it stays on disk).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from veoptim.checkpoint.layout import (
    VERSIONS_DIR,
    link_path,
    manifest_path,
    parse_link_target,
    validate_name,
    version_dir,
)
from veoptim.checkpoint.manifest import KIND_CHECKPOINT, Manifest, read_manifest, verify
from veoptim.distributed.agreement import on_rank0
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)


def read_link(root: Path, name: str) -> str | None:
    """The version id ``name`` points to; None if ``name`` is not a symlink.

    Raises ``CheckpointError`` if the link's target is anything but ``.versions/<id>``
    (absolute, ``..``, another name, a path outside the root).
    """
    path = link_path(root, name)
    if not path.is_symlink():
        return None
    try:
        target = os.readlink(path)
    except FileNotFoundError:
        return None  # retention pruned the name just now
    version_id = parse_link_target(target)
    if version_id is None:
        raise CheckpointError(
            f"Checkpoint link {path} points to {target!r}; a checkpoint name must point to "
            f"'{VERSIONS_DIR}/<version>' inside its root (links escaping the root are refused)."
        )
    return version_id


def published_names(root: Path) -> dict[str, str]:
    """Every valid name link in ``root`` -> its version id (malformed links are skipped)."""
    out: dict[str, str] = {}
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        try:
            validate_name(entry)
            version_id = read_link(Path(root), entry)
        except (CheckpointError, OSError):
            continue
        if version_id is not None:
            out[entry] = version_id
    return out


def is_within(path: Path, root: Path) -> bool:
    """True iff the real location of ``path`` is ``root``'s real location or below it
    (a ``.versions`` that is itself a symlink must not lead a reader out of the root)."""
    real, real_root = Path(path).resolve(), Path(root).resolve()
    return real == real_root or real_root in real.parents


def check_complete(version: Path, *, verify_checksums: bool = True) -> Manifest:
    """The manifest of ``version`` if the version is complete, else ``CheckpointError``."""
    manifest = read_manifest(version)
    verify(version, manifest, checksums=verify_checksums)
    return manifest


def _checked_version(root: Path, version_id: str, via: str, verify_checksums: bool) -> Path:
    path = version_dir(root, version_id)
    if path.is_symlink() or not is_within(path, root):
        raise CheckpointError(f"Checkpoint {via} resolves to {path.resolve()}, outside {root}.")
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint {via} points to {path}, which does not exist.")
    real = path.resolve()
    check_complete(real, verify_checksums=verify_checksums)
    return real


def resolve(root: Path, name: str, *, verify_checksums: bool = True) -> Path:
    """The complete version directory ``name`` points to now (absolute, symlink-free).

    A legacy plain directory is returned as is (verified if it has a manifest; a warning
    says its completeness cannot be checked if it has none).
    """
    root = Path(root)
    path = link_path(root, name)
    version_id = read_link(root, name)
    if version_id is not None:
        return _checked_version(root, version_id, f"{name!r} in {root}", verify_checksums)
    if not path.is_dir():
        raise CheckpointError(f"No checkpoint named {name!r} in {root} (expected {path}).")
    if manifest_path(path).exists():
        check_complete(path, verify_checksums=verify_checksums)
    else:
        log.warning("Legacy checkpoint %s has no manifest; its completeness is not checked.", path)
    return path.resolve()


def resolve_version(root: Path, version_id: str, *, verify_checksums: bool = True) -> Path:
    """A pinned version ``.versions/<version_id>``, checked complete."""
    root = Path(root)
    return _checked_version(root, version_id, f"version {version_id!r}", verify_checksums)


def resolve_path(path: Path, *, verify_checksums: bool = True) -> Path:
    """A checkpoint given by path: a name link, a pinned ``.versions/<id>`` or a plain dir."""
    path = Path(path)
    if path.is_symlink():
        return resolve(path.parent, path.name, verify_checksums=verify_checksums)
    if path.parent.name == VERSIONS_DIR:
        return resolve_version(path.parent.parent, path.name, verify_checksums=verify_checksums)
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint path {path} does not exist or is not a directory.")
    return resolve(path.parent, path.name, verify_checksums=verify_checksums)


def resolve_reference(root: Path, ref: str, *, verify_checksums: bool = True) -> Path:
    """``checkpoint.resume=<ref>``: a plain name is looked up in ``root``; a ref holding a
    path separator (or starting with ``.``/``~``) is a path (``.versions/<id>`` pins a version)."""
    if os.sep in ref or "/" in ref or ref.startswith((".", "~")):
        candidate = Path(ref).expanduser()
        if not candidate.is_absolute() and not candidate.exists():
            candidate = Path(root) / candidate
        return resolve_path(candidate, verify_checksums=verify_checksums)
    return resolve(root, ref, verify_checksums=verify_checksums)


def _order_key(name: str, manifest: Manifest) -> tuple[int, int, int]:
    step = -1 if manifest.step is None else manifest.step
    return (step, manifest.created_ns, int(name == manifest.name))


def latest_complete(root: Path, kind: str = KIND_CHECKPOINT) -> str | None:
    """The name of the newest complete checkpoint of ``kind`` in ``root``, or None.

    Newest = highest manifest ``step`` (versions without a step count as -1), ties broken
    by the manifest's creation time, then by preferring the name a version was published
    under over another name linked to it by hand. Incomplete versions and legacy
    directories without a manifest are skipped with a warning.
    """
    root = Path(root)
    candidates: list[tuple[tuple[int, int, int], str]] = []
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return None
    for entry in entries:
        try:
            validate_name(entry)
        except CheckpointError:
            continue
        try:
            version_id = read_link(root, entry)
            path = version_dir(root, version_id) if version_id else root / entry
            if not path.is_dir():
                continue
            manifest = read_manifest(path)
        except CheckpointError as exc:
            log.warning("Skipping checkpoint %r in %s: %s", entry, root, exc)
            continue
        if manifest.kind == kind:
            candidates.append((_order_key(entry, manifest), entry))
    for _, name in sorted(candidates, reverse=True):
        try:
            resolve(root, name)
        except CheckpointError as exc:
            log.warning("Skipping incomplete checkpoint %r: %s", name, exc)
            continue
        return name
    return None


def resolve_agreed(root: Path, ref: str, group: Any = None) -> Path | None:
    """Rank 0 resolves ``ref`` once (``"auto"``: the newest complete version, None in a root
    without one); every rank gets the same version directory, or every rank raises the same
    ``CheckpointError``."""

    def find() -> str | None:
        target = latest_complete(root) if ref == "auto" else ref
        return None if target is None else str(resolve_reference(root, target))

    found = on_rank0(find, f"resolving checkpoint {ref!r}", group)
    return None if found is None else Path(found)
