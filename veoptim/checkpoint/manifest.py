"""The manifest: the last file of a version, listing every other file with its size.

Checksums: files up to ``CHECKSUM_MAX_BYTES`` get a SHA-256 (metadata, JSON state,
scheduler/RNG files, small adapters), read back, or taken from the bytes the writer
noted it wrote (``PendingVersion.note_written``: the checkpointer's JSON files). Larger
files (multi-GB DCP shards, safetensors) get their size only: hashing them would re-read
every byte the save just wrote and roughly double the save's I/O time, while their
integrity inside is covered by the loader's validation (DCP metadata, tensor shapes). The
manifest is written in place and flushed by the publisher together with the version's
directories; it is reachable only once the name moves to the version, after that flush, so
a partial manifest (a crash while writing it) can only exist in an unpublished version,
which no name points to and the next save removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from veoptim.checkpoint.layout import MANIFEST_FILE, MANIFEST_TEMP_FILE, manifest_path
from veoptim.errors import CheckpointError

MANIFEST_FORMAT = "veoptim.checkpoint.manifest"
MANIFEST_FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "sha256"
CHECKSUM_MAX_BYTES = 16 * 1024 * 1024
KIND_CHECKPOINT = "checkpoint"
_READ_CHUNK = 1024 * 1024
_IGNORED = frozenset({MANIFEST_FILE, MANIFEST_TEMP_FILE})

KEY_FORMAT = "format"
KEY_FORMAT_VERSION = "format_version"
KEY_NAME = "name"
KEY_KIND = "kind"
KEY_STEP = "step"
KEY_CREATED_NS = "created_ns"
KEY_WORLD_SIZE = "world_size"
KEY_FILES = "files"
KEY_SIZE = "size"
KEY_PRUNABLE = "prunable"


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    """What a version holds. ``name`` is the name the version was first published under."""

    name: str
    kind: str
    step: int | None
    created_ns: int
    world_size: int
    files: dict[str, FileEntry]
    prunable: bool = True

    def to_json(self) -> dict[str, Any]:
        files = {}
        for rel, entry in sorted(self.files.items()):
            files[rel] = {KEY_SIZE: entry.size}
            if entry.sha256 is not None:
                files[rel][CHECKSUM_ALGORITHM] = entry.sha256
        return {
            KEY_FORMAT: MANIFEST_FORMAT,
            KEY_FORMAT_VERSION: MANIFEST_FORMAT_VERSION,
            KEY_NAME: self.name,
            KEY_KIND: self.kind,
            KEY_STEP: self.step,
            KEY_CREATED_NS: self.created_ns,
            KEY_WORLD_SIZE: self.world_size,
            KEY_PRUNABLE: self.prunable,
            KEY_FILES: files,
        }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_relpath(rel: str, where: Path) -> None:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or str(p) != rel:
        raise CheckpointError(f"Manifest {where} lists an unsafe file path {rel!r}.")


def scan_tree(version: Path) -> tuple[dict[str, int], list[str]]:
    """Relative POSIX path -> size of every regular file under ``version`` (manifest
    excluded), and every directory (``version`` first), in one walk.

    A symlink or special file inside a version is an error: a version must be self-contained.
    """
    found: dict[str, int] = {}
    dirs: list[str] = []
    pending = [(str(version), "")]
    while pending:
        directory, prefix = pending.pop()
        dirs.append(directory)
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, rel + "/"))
                elif entry.is_file(follow_symlinks=False):
                    if rel not in _IGNORED:
                        found[rel] = entry.stat(follow_symlinks=False).st_size
                else:
                    raise CheckpointError(
                        f"Checkpoint version {version} must hold only regular files and "
                        f"directories, found {entry.path}."
                    )
    return found, dirs


def scan_files(version: Path) -> dict[str, int]:
    """The files of :func:`scan_tree`."""
    return scan_tree(version)[0]


def build_manifest(
    version: Path,
    *,
    name: str,
    kind: str,
    step: int | None,
    world_size: int,
    prunable: bool = True,
    files: dict[str, int] | None = None,
    known_sha256: Mapping[str, str] | None = None,
) -> Manifest:
    """Describe every file now in ``version`` (sizes; SHA-256 of small files). ``files``:
    its :func:`scan_tree` files when the caller just scanned it; ``known_sha256``: the
    SHA-256 of files whose bytes the caller wrote itself (not read back)."""
    known = known_sha256 or {}
    entries = {}
    for rel, size in sorted((scan_files(version) if files is None else files).items()):
        digest = None
        if size <= CHECKSUM_MAX_BYTES:
            digest = known[rel] if rel in known else _sha256(version / rel)
        entries[rel] = FileEntry(size=size, sha256=digest)
    return Manifest(
        name=name,
        kind=kind,
        step=step,
        created_ns=time.time_ns(),
        world_size=world_size,
        files=entries,
        prunable=prunable,
    )


def write_manifest(version: Path, manifest: Manifest) -> Path:
    """Write the manifest (unflushed: the publisher flushes it with the directories, one
    merged flush instead of a temporary file's fsync, rename and directory fsync)."""
    final = manifest_path(version)
    final.write_bytes(json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode())
    return final


def _parse(raw: Any, where: Path) -> Manifest:
    """Keys this veoptim does not use (e.g. ``metadata``, written by earlier releases) are
    ignored, so those manifests still read."""
    if not isinstance(raw, dict) or raw.get(KEY_FORMAT) != MANIFEST_FORMAT:
        raise CheckpointError(f"{where} is not a veoptim checkpoint manifest.")
    if raw.get(KEY_FORMAT_VERSION) != MANIFEST_FORMAT_VERSION:
        raise CheckpointError(
            f"Manifest {where} has format version {raw.get(KEY_FORMAT_VERSION)!r}, this "
            f"veoptim reads version {MANIFEST_FORMAT_VERSION}; use a matching veoptim release."
        )
    try:
        files = {}
        for rel, entry in raw[KEY_FILES].items():
            _check_relpath(rel, where)
            files[rel] = FileEntry(size=int(entry[KEY_SIZE]), sha256=entry.get(CHECKSUM_ALGORITHM))
        step = raw[KEY_STEP]
        return Manifest(
            name=str(raw[KEY_NAME]),
            kind=str(raw[KEY_KIND]),
            step=None if step is None else int(step),
            created_ns=int(raw[KEY_CREATED_NS]),
            world_size=int(raw[KEY_WORLD_SIZE]),
            files=files,
            prunable=bool(raw[KEY_PRUNABLE]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"Manifest {where} is malformed: {exc!r}.") from exc


def read_manifest(version: Path) -> Manifest:
    """Parse ``version``'s manifest; a missing or unknown manifest is a ``CheckpointError``."""
    path = manifest_path(version)
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"Checkpoint {version} is incomplete: {MANIFEST_FILE} is missing (the save "
            f"did not finish)."
        ) from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Cannot read manifest {path}: {exc}.") from exc
    return _parse(raw, path)


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
            digest = _sha256(version / rel)
        except OSError as exc:  # e.g. retention removed the version while it was checked
            raise CheckpointError(f"Cannot read checkpoint file {version / rel}: {exc}.") from exc
        if digest != entry.sha256:
            raise CheckpointError(
                f"Checkpoint file {version / rel} does not match its {CHECKSUM_ALGORITHM} "
                f"in the manifest (corrupted or modified)."
            )
