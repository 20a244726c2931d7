"""The readers of a checkpoint root: a reference resolved to one complete version, checked
against its manifest once (the on-disk contract is ``layout.py``'s; docs/checkpoints.md).

Readers resolve a name once to a complete, immutable version directory inside the root
and read every file from that directory, never through the name again: a concurrent save
may re-point the name, but the returned version stays as it is.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.checkpoint.layout import (
    CHECKSUM_ALGORITHM,
    KIND_CHECKPOINT,
    VERSIONS_DIR,
    Manifest,
    link_path,
    manifest_path,
    names_in,
    published_names,
    read_link,
    read_manifest,
    scan_tree,
    sha256_of,
    version_dir,
)
from veoptim.distributed.agreement import on_rank0
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)

#: A resolved version directory and its manifest (None: a legacy directory without one).
Found = tuple[Path, Manifest | None]


@dataclass(frozen=True)
class Resolved:
    """A checkpoint reference resolved to one complete version: how it was named (the
    reference, or the name ``auto`` chose), where it is, which run published it (None: a
    version from before run ids, or a legacy directory) and at what step."""

    name: str
    path: Path
    run: str | None
    step: int | None


def is_within(path: Path, root: Path) -> bool:
    """True iff the real location of ``path`` is ``root``'s real location or below it
    (a ``.versions`` that is itself a symlink must not lead a reader out of the root)."""
    real, real_root = Path(path).resolve(), Path(root).resolve()
    return real == real_root or real_root in real.parents


def scan_files(version: Path) -> dict[str, int]:
    """The files of :func:`scan_tree`."""
    return scan_tree(version)[0]


def verify(version: Path, manifest: Manifest, *, checksums: bool = True) -> None:
    """Raise ``CheckpointError`` unless the files in ``version`` match ``manifest`` exactly."""
    try:
        found = scan_files(version)
    except OSError as exc:
        raise CheckpointError(f"Cannot list checkpoint {version}: {exc}.") from exc
    missing = sorted(set(manifest.files) - set(found))
    extra = sorted(set(found) - set(manifest.files))
    if missing or extra:
        raise CheckpointError(
            f"Checkpoint {version} does not match its manifest: missing {missing[:5]}, "
            f"unexpected {extra[:5]}."
        )
    for rel, entry in manifest.files.items():
        if found[rel] != entry.size:
            raise CheckpointError(
                f"Checkpoint file {version / rel} has {found[rel]} bytes, its manifest "
                f"says {entry.size}."
            )
        if not checksums or entry.sha256 is None:
            continue
        try:
            digest = sha256_of(version / rel)
        except OSError as exc:  # e.g. retention removed the version while it was checked
            raise CheckpointError(f"Cannot read checkpoint file {version / rel}: {exc}.") from exc
        if digest != entry.sha256:
            raise CheckpointError(
                f"Checkpoint file {version / rel} does not match its {CHECKSUM_ALGORITHM} "
                f"in the manifest (corrupted or modified)."
            )


def check_complete(version: Path, *, verify_checksums: bool = True) -> Manifest:
    """The manifest of ``version`` if the version is complete, else ``CheckpointError``:
    one read of the manifest, one verification."""
    manifest = read_manifest(version)
    verify(version, manifest, checksums=verify_checksums)
    return manifest


def _checked_version(root: Path, version_id: str, via: str, verify_checksums: bool) -> Found:
    path = version_dir(root, version_id)
    if path.is_symlink() or not is_within(path, root):
        raise CheckpointError(f"Checkpoint {via} resolves to {path.resolve()}, outside {root}.")
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint {via} points to {path}, which does not exist.")
    real = path.resolve()
    return real, check_complete(real, verify_checksums=verify_checksums)


def _resolve(root: Path, name: str, *, verify_checksums: bool) -> Found:
    root = Path(root)
    path = link_path(root, name)
    version_id = read_link(root, name)
    if version_id is not None:
        return _checked_version(root, version_id, f"{name!r} in {root}", verify_checksums)
    if not path.is_dir():
        raise CheckpointError(f"No checkpoint named {name!r} in {root} (expected {path}).")
    manifest = None
    if manifest_path(path).exists():
        manifest = check_complete(path, verify_checksums=verify_checksums)
    else:
        log.warning("Legacy checkpoint %s has no manifest; its completeness is not checked.", path)
    return path.resolve(), manifest


def _resolve_path(path: Path, *, verify_checksums: bool) -> Found:
    path = Path(path)
    if path.is_symlink():
        return _resolve(path.parent, path.name, verify_checksums=verify_checksums)
    if path.parent.name == VERSIONS_DIR:
        root, version_id = path.parent.parent, path.name
        return _checked_version(root, version_id, f"version {version_id!r}", verify_checksums)
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint path {path} does not exist or is not a directory.")
    return _resolve(path.parent, path.name, verify_checksums=verify_checksums)


def _resolve_reference(root: Path, ref: str, *, verify_checksums: bool) -> Found:
    if os.sep in ref or "/" in ref or ref.startswith((".", "~")):
        candidate = Path(ref).expanduser()
        if not candidate.is_absolute() and not candidate.exists():
            candidate = Path(root) / candidate
        return _resolve_path(candidate, verify_checksums=verify_checksums)
    return _resolve(root, ref, verify_checksums=verify_checksums)


def resolve(root: Path, name: str, *, verify_checksums: bool = True) -> Path:
    """The complete version directory ``name`` points to now (absolute, symlink-free).

    A legacy plain directory is returned as is (verified if it has a manifest; a warning
    says its completeness cannot be checked if it has none).
    """
    return _resolve(root, name, verify_checksums=verify_checksums)[0]


def resolve_version(root: Path, version_id: str, *, verify_checksums: bool = True) -> Path:
    """A pinned version ``.versions/<version_id>``, checked complete."""
    via = f"version {version_id!r}"
    return _checked_version(Path(root), version_id, via, verify_checksums)[0]


def resolve_path(path: Path, *, verify_checksums: bool = True) -> Path:
    """A checkpoint given by path: a name link, a pinned ``.versions/<id>`` or a plain dir."""
    return _resolve_path(path, verify_checksums=verify_checksums)[0]


def resolve_reference(root: Path, ref: str, *, verify_checksums: bool = True) -> Path:
    """``checkpoint.resume=<ref>``: a plain name is looked up in ``root``; a ref holding a
    path separator (or starting with ``.``/``~``) is a path (``.versions/<id>`` pins a version)."""
    return _resolve_reference(root, ref, verify_checksums=verify_checksums)[0]


def _order_key(name: str, manifest: Manifest) -> tuple[int, int, int]:
    step = -1 if manifest.step is None else manifest.step
    return (step, manifest.created_ns, int(name == manifest.name))


#: How often :func:`newest_complete` scans a root whose names keep changing under it.
RESCANS = 5


def latest_complete(
    root: Path, kind: str = KIND_CHECKPOINT, *, run: str | None = None
) -> str | None:
    """The name of the newest complete checkpoint of ``kind`` in ``root``, or None.

    Newest = highest manifest ``step`` (versions without a step count as -1), ties broken
    by the manifest's creation time, then by preferring the name a version was published
    under over another name linked to it by hand. Incomplete versions and legacy
    directories without a manifest are skipped with a warning. ``run``: only versions
    that run published (None: any run's).
    """
    found = newest_complete(root, kind, run=run)
    return None if found is None else found[0]


def newest_complete(
    root: Path, kind: str = KIND_CHECKPOINT, *, run: str | None = None
) -> tuple[str, Path] | None:
    """:func:`latest_complete`'s name and the version directory it resolved to (checked
    complete once, here).

    A process saving into ``root`` meanwhile can move or prune every name a scan listed
    before the scan reads it; a scan that finds nothing while the names changed under it
    is repeated (at most :data:`RESCANS` times), so a reader does not take a busy root
    for an empty one."""
    found = _newest(Path(root), kind, run)
    return None if found is None else (found[0], found[1][0])


def _newest(root: Path, kind: str, run: str | None) -> tuple[str, Found] | None:
    for _ in range(RESCANS):
        before = published_names(root)
        found = _scan_newest_complete(root, kind, run)
        if found is not None or published_names(root) == before:
            return found
    return None


def _scan_newest_complete(root: Path, kind: str, run: str | None) -> tuple[str, Found] | None:
    candidates: list[tuple[tuple[int, int, int], str]] = []
    for entry in names_in(root):
        try:
            version_id = read_link(root, entry)
            path = version_dir(root, version_id) if version_id else root / entry
            if not path.is_dir():
                continue
            manifest = read_manifest(path)
        except CheckpointError as exc:
            log.warning("Skipping checkpoint %r in %s: %s", entry, root, exc)
            continue
        if manifest.kind == kind and (run is None or manifest.run == run):
            candidates.append((_order_key(entry, manifest), entry))
    for _, name in sorted(candidates, reverse=True):
        try:
            return name, _resolve(root, name, verify_checksums=True)
        except CheckpointError as exc:
            log.warning("Skipping incomplete checkpoint %r: %s", name, exc)
    return None


def _described(name: str, found: Found) -> Resolved:
    path, manifest = found
    if manifest is None:  # a legacy directory without a manifest
        return Resolved(name, path, None, None)
    return Resolved(name, path, manifest.run, manifest.step)


def locate(root: Path, ref: str, *, run: str | None = None) -> Resolved | None:
    """This process alone resolves ``ref`` (``"auto"``: the newest complete version that
    ``run`` published, or any run's when ``run`` is None; None in a root without one),
    checking the version against its manifest once; the run and step come from that
    same read. A named ``ref`` is resolved whichever run wrote it."""
    if ref != "auto":
        return _described(ref, _resolve_reference(root, ref, verify_checksums=True))
    found = _newest(Path(root), KIND_CHECKPOINT, run)
    return None if found is None else _described(*found)


def locate_path(path: Path) -> Resolved:
    """:func:`resolve_path`, described as :func:`locate` describes (one manifest read)."""
    return _described(str(path), _resolve_path(Path(path), verify_checksums=True))


def resolve_agreed(
    root: Path, ref: str, group: Any = None, *, run: str | None = None
) -> Resolved | None:
    """Rank 0 :func:`locate`s ``ref`` once; every rank gets the same version, or every rank
    raises the same ``CheckpointError``."""
    return on_rank0(lambda: locate(root, ref, run=run), f"resolving checkpoint {ref!r}", group)
