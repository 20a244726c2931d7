"""Names, versions and manifests on disk: the contract every writer and reader of a
checkpoint root keeps, the manifest that makes a version complete, and the readers that
resolve a name to a complete version. Writing (publication, retention) lives in
``publish.py``; the bytes inside a version belong to its writer.

A checkpoint root is a directory that holds published *names* and immutable *versions*::

    <root>/
      step_00000100 -> .versions/step_00000100.3f2a9c1d0b7e4a55   (relative symlink: a name)
      step_00000200 -> .versions/step_00000200.9b1c4e7a22d04f10
      hf_final      -> .versions/hf_final.c0ffee0123456789
      old_run/                                                    (legacy plain directory)
      .versions/
        step_00000100.3f2a9c1d0b7e4a55/    (a version: written once, never modified)
          manifest.json                    (written last; lists every other file)
          ... writer's files (DCP shards, JSON, safetensors, ...)
      .tmp-link.step_00000300.<token>      (a publish in progress or a crashed one)

* A *name* matches ``NAME_PATTERN``: one path component, no leading dot (so a name can
  never collide with ``.versions`` or a temporary link), no separator, no ``..``.
* A *version id* is ``<name it was first published under>.<16 hex digits>``; the token is
  random (``uuid4``), chosen by rank 0 and broadcast, so every rank writes into the same
  directory. Ordering never relies on the token.
* A name's symlink target is exactly ``.versions/<version id>`` (relative, one level, no
  ``..``), so the root can be moved or mounted elsewhere. Anything else is rejected on read.
* A version is *complete* iff ``manifest.json`` is present, parses, and matches the files in
  the directory (same set, same sizes, same checksums where recorded).
* ``.tmp-link.<name>.<token>`` is a temporary symlink created next to the name and then
  ``os.replace``-d over it; one that survives is debris of a crashed publish.
* A *legacy* checkpoint is a plain directory under a name. A checkpoint copied from another
  machine with ``cp -r`` (or ``rsync`` without ``-l``) becomes one, so it stays readable,
  but it is never overwritten: it may be the only copy.

The manifest is the last file of a version, listing every other file with its size.
Checksums: files up to ``CHECKSUM_MAX_BYTES`` get a SHA-256 (metadata, JSON state,
scheduler/RNG files, small adapters), read back, or taken from the bytes the writer
noted it wrote (``PendingVersion.write_files``: the checkpointer's JSON files). Larger
files (multi-GB DCP shards, safetensors) get their size only: hashing them would re-read
every byte the save just wrote and roughly double the save's I/O time, while their
integrity inside is covered by the loader's validation (DCP metadata, tensor shapes). The
manifest is written in place and flushed by the publisher together with the version's
directories; it is reachable only once the name moves to the version, after that flush, so
a partial manifest (a crash while writing it) can only exist in an unpublished version,
which no name points to and the next save removes.

Readers resolve a name once to a complete, immutable version directory inside the root.
A reader must read every file from the directory ``resolve`` returns, never through the
name again: a concurrent save may re-point the name, but the returned version stays as it
is (see ``docs/checkpoints.md`` for how long it stays on disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from veoptim.distributed.agreement import on_rank0
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)


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
    run: str | None = None,
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
        run=run,
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


# ---------------------------------------------------------------- readers
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


def _names_in(root: Path) -> list[str]:
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
    for entry in _names_in(root):
        try:
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
    root = Path(root)
    for _ in range(RESCANS):
        before = published_names(root)
        found = _scan_newest_complete(root, kind, run)
        if found is not None or published_names(root) == before:
            return found
    return None


def _scan_newest_complete(root: Path, kind: str, run: str | None) -> tuple[str, Path] | None:
    candidates: list[tuple[tuple[int, int, int], str]] = []
    for entry in _names_in(root):
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
            return name, resolve(root, name)
        except CheckpointError as exc:
            log.warning("Skipping incomplete checkpoint %r: %s", name, exc)
    return None


@dataclass(frozen=True)
class Resolved:
    """A checkpoint reference resolved to one complete version: how it was named (the
    reference, or the name ``auto`` chose), where it is, which run published it (None: a
    version from before run ids, or a legacy directory) and at what step."""

    name: str
    path: Path
    run: str | None
    step: int | None


def _described(name: str, path: Path) -> Resolved:
    """The run and step a resolved (already checked) version records."""
    if not manifest_path(path).exists():  # a legacy directory without a manifest
        return Resolved(name, path, None, None)
    manifest = read_manifest(path)
    return Resolved(name, path, manifest.run, manifest.step)


def resolve_agreed(
    root: Path, ref: str, group: Any = None, *, run: str | None = None
) -> Resolved | None:
    """Rank 0 resolves ``ref`` once (``"auto"``: the newest complete version that ``run``
    published, or any run's when ``run`` is None; None in a root without one); every rank
    gets the same version, or every rank raises the same ``CheckpointError``. A named
    ``ref`` is resolved whichever run wrote it."""

    def find() -> Resolved | None:
        if ref != "auto":
            return _described(ref, resolve_reference(root, ref))
        found = newest_complete(root, run=run)
        return None if found is None else _described(*found)

    return on_rank0(find, f"resolving checkpoint {ref!r}", group)
