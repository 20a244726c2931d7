"""A checkpoint root on disk: its names, versions and manifests (the contract every writer
and reader of a root keeps; docs/checkpoints.md describes it in full).

    <root>/step_00000100 -> .versions/step_00000100.3f2a9c1d0b7e4a55   (a name: relative link)
    <root>/.versions/step_00000100.3f2a9c1d0b7e4a55/manifest.json      (written last)
    <root>/.tmp-link.<name>.<token>                      (a publish in progress, or debris)

* A *name* matches ``NAME_PATTERN``: one path component, no leading dot, no ``..``.
* A *version id* is ``<name it was first published under>.<16 hex digits>`` (random).
* A name's link target is exactly ``.versions/<version id>``; anything else is refused.
* A version is *complete* iff ``manifest.json`` parses and matches its files (the readers
  check it: ``versions.py``). Small files get a SHA-256; large ones (DCP shards,
  safetensors) their size only, since hashing them would re-read every byte a save wrote.
* A *legacy* checkpoint is a plain directory under a name (e.g. copied with ``cp -r``):
  readable, never overwritten.

Nothing here writes a name or removes a version: publication and retention do
(``publish.py``, through its storage seam). Starts without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from veoptim.errors import CheckpointError

# ---------------------------------------------------------------- names and versions
VERSIONS_DIR = ".versions"
TEMP_LINK_PREFIX = ".tmp-link."
MANIFEST_FILE = "manifest.json"
MANIFEST_TEMP_FILE = ".manifest.json.tmp"
STEP_NAME_FORMAT = "step_{step:08d}"
NAME_MAX_LEN = 200
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
VERSION_TOKEN_HEX_LEN = 16
VERSION_ID_PATTERN = re.compile(
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]*)\.(?P<token>[0-9a-f]{"
    + str(VERSION_TOKEN_HEX_LEN)
    + "})"
)


def validate_name(name: str) -> str:
    """Return ``name`` if it is a safe checkpoint name, else raise ``CheckpointError``."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"Checkpoint name must be a non-empty string, got {name!r}.")
    if (
        len(name) > NAME_MAX_LEN
        or not NAME_PATTERN.fullmatch(name)
        or ".." in name
        or name.endswith(".")
    ):
        raise CheckpointError(
            f"Checkpoint name {name!r} is not allowed: expected one path component of letters, "
            f"digits, '_', '-' and '.', starting with a letter or digit, without '..', at most "
            f"{NAME_MAX_LEN} characters (no '/', no absolute path, no leading dot)."
        )
    return name


def step_name(step: int) -> str:
    """The conventional name of the checkpoint saved at optimizer step ``step``."""
    return STEP_NAME_FORMAT.format(step=step)


def versions_dir(root: Path) -> Path:
    return Path(root) / VERSIONS_DIR


def link_path(root: Path, name: str) -> Path:
    """Where the public symlink (or legacy directory) of ``name`` lives."""
    return Path(root) / validate_name(name)


def new_version_id(name: str) -> str:
    """A fresh version id for a version first published as ``name`` (random token)."""
    return f"{validate_name(name)}.{uuid.uuid4().hex[:VERSION_TOKEN_HEX_LEN]}"


def is_version_id(version_id: str) -> bool:
    return bool(VERSION_ID_PATTERN.fullmatch(version_id)) and ".." not in version_id


def version_dir(root: Path, version_id: str) -> Path:
    if not is_version_id(version_id):
        raise CheckpointError(
            f"Expected a checkpoint version id like 'step_00000100.<16 hex digits>', "
            f"got {version_id!r} under {versions_dir(root)}."
        )
    return versions_dir(root) / version_id


def link_target(version_id: str) -> str:
    """The relative symlink target stored in a name's link."""
    if not is_version_id(version_id):
        raise CheckpointError(f"Not a checkpoint version id: {version_id!r}.")
    return f"{VERSIONS_DIR}/{version_id}"


def parse_link_target(target: str) -> str | None:
    """The version id a link target names, or None if it is not exactly ``.versions/<id>``."""
    prefix = VERSIONS_DIR + "/"
    if not target.startswith(prefix):
        return None
    version_id = target[len(prefix) :]
    return version_id if is_version_id(version_id) else None


def temp_link_path(root: Path, name: str, token: str) -> Path:
    return Path(root) / f"{TEMP_LINK_PREFIX}{validate_name(name)}.{token}"


def is_temp_link_name(entry: str) -> bool:
    return entry.startswith(TEMP_LINK_PREFIX)


def manifest_path(version: Path) -> Path:
    return Path(version) / MANIFEST_FILE


# ---------------------------------------------------------------- the manifest
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
KEY_RUN = "run"


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
    #: The run id of the run that published it (None: written before run ids, or by a
    #: writer outside any run).
    run: str | None = None

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
            KEY_RUN: self.run,
            KEY_FILES: files,
        }


def sha256_of(path: Path) -> str:
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


def build_manifest(
    version: Path,
    *,
    name: str,
    kind: str,
    step: int | None,
    world_size: int,
    prunable: bool = True,
    run: str | None = None,
    files: dict[str, int] | None = None,
    known_sha256: Mapping[str, str] | None = None,
) -> Manifest:
    """Describe every file now in ``version`` (sizes; SHA-256 of small files). ``files``:
    its :func:`scan_tree` files when the caller just scanned it; ``known_sha256``: the
    SHA-256 of files whose bytes the caller wrote itself (not read back)."""
    known = known_sha256 or {}
    entries = {}
    for rel, size in sorted((scan_tree(version)[0] if files is None else files).items()):
        digest = None
        if size <= CHECKSUM_MAX_BYTES:
            digest = known[rel] if rel in known else sha256_of(version / rel)
        entries[rel] = FileEntry(size=size, sha256=digest)
    return Manifest(
        name=name,
        kind=kind,
        step=step,
        created_ns=time.time_ns(),
        world_size=world_size,
        files=entries,
        prunable=prunable,
        run=run,
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    """The bytes of ``manifest.json`` for ``manifest``."""
    return json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode()


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
            run=None if raw.get(KEY_RUN) is None else str(raw[KEY_RUN]),
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


# ---------------------------------------------------------------- names in a root
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


def names_in(root: Path) -> list[str]:
    """The entries of ``root`` that can be names, sorted (none if ``root`` does not exist)."""
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [entry for entry in entries if _is_name(entry)]


def _is_name(entry: str) -> bool:
    try:
        validate_name(entry)
    except CheckpointError:
        return False
    return True


def published_names(root: Path) -> dict[str, str]:
    """Every valid name link in ``root`` -> its version id (malformed links are skipped)."""
    out: dict[str, str] = {}
    for entry in names_in(root):
        try:
            version_id = read_link(Path(root), entry)
        except (CheckpointError, OSError):
            continue
        if version_id is not None:
            out[entry] = version_id
    return out
