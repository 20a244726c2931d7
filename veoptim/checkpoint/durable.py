"""Flushing to stable storage: fsync of files and directories (why: see docs/checkpoints.md).

Directory fsync makes entries (a new file, a rename) durable; filesystems that cannot
fsync a directory (some network filesystems answer EINVAL) are treated as having nothing
to flush.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_UNSUPPORTED_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)


def fsync_dir(path: Path) -> None:
    """fsync a directory's entries; a no-op where the filesystem cannot (EINVAL, ...)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def fsync_tree(path: Path, *, files: bool, dirs: bool) -> None:
    """fsync every regular file and/or every directory under ``path`` (directories last)."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        if files:
            for entry in filenames:
                full = os.path.join(dirpath, entry)
                if os.path.isfile(full) and not os.path.islink(full):
                    fd = os.open(full, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        if dirs:
            fsync_dir(Path(dirpath))
