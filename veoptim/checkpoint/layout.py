"""Every path inside a checkpoint root, as pure functions (no I/O). This docstring is the
on-disk contract; reading and writing it live in ``resolve.py``, ``publish.py`` and
``retention.py``.

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
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from veoptim.errors import CheckpointError

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
