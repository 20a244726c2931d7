"""Flushing to stable storage: fsync of files and directories (why: see docs/checkpoints.md).

Directory fsync makes entries (a new file, a rename) durable; filesystems that cannot
fsync a directory (some network filesystems answer EINVAL) are treated as having nothing
to flush.

Many fsyncs are issued concurrently (:func:`fsync_all`): every fsync, even of a file that
is already clean, makes the filesystem flush the device's write cache (ext4 sends a
flush for each), and the block layer merges flushes that are pending at the same time.
Measured on the development VM: 8 small files fsynced one after another took 24-26 ms,
the same 8 concurrently 0.5-1 ms. Each path is still fsynced; only the waiting overlaps.
The threads are kept between batches: starting a fresh pool of six for a publication's
manifest and directories cost 0.6-0.9 ms, more than the six fsyncs themselves (0.3 ms).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_UNSUPPORTED_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)
#: Most fsyncs in flight at once.
MAX_CONCURRENT_FSYNCS = 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    """The process's fsync threads (started on first use, idle between batches)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_CONCURRENT_FSYNCS, thread_name_prefix="veoptim-fsync")
        return _pool


def _forget_pool() -> None:
    """In a forked child the parent's threads do not exist: start a pool of its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """fsync a directory's entries; a no-op where the filesystem cannot (EINVAL, ...)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def fsync_all(files: Iterable[Path | str] = (), dirs: Iterable[Path | str] = ()) -> None:
    """fsync every file and directory given, concurrently; returns when all are durable
    (the first error is raised after every fsync finished)."""
    jobs = [(fsync_file, f) for f in files] + [(fsync_dir, d) for d in dirs]
    if len(jobs) <= 1:
        for flush, path in jobs:
            flush(path)
        return
    pool = _fsync_pool()
    futures = [pool.submit(flush, path) for flush, path in jobs]
    errors = [future.exception() for future in futures]  # waits for every one
    for error in errors:
        if error is not None:
            raise error


def tree(path: Path) -> tuple[list[str], list[str]]:
    """Every regular file and every directory under ``path`` (``path`` included)."""
    files, dirs = [], []
    for dirpath, _, filenames in os.walk(path):
        dirs.append(dirpath)
        for entry in filenames:
            full = os.path.join(dirpath, entry)
            if os.path.isfile(full) and not os.path.islink(full):
                files.append(full)
    return files, dirs


def fsync_tree(path: Path, *, files: bool, dirs: bool) -> None:
    """fsync every regular file and/or every directory under ``path``, concurrently."""
    found_files, found_dirs = tree(path)
    fsync_all(found_files if files else (), found_dirs if dirs else ())
