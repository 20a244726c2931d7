"""The DCP storage behind the checkpoint store: its one door.

Everything that moves bytes of a version to or from disk is here, so the phase logic above
it (``checkpointer.py``, ``reader.py``; ``disk.py`` for durability) reads as a sequence of phases:

* tensors: :func:`tensor_writer` (the ``raw`` layout of ``raw_format.py``, or DCP's own),
  :func:`save_tensors` / :func:`load_tensors` (DCP's planner and collectives, failures
  turned into one readable ``CheckpointError``), :func:`read_metadata` (the allow-list
  unpickler of ``safe_dcp.py``) and :func:`reading_ahead` (``readahead.py``);
* durability: :func:`fsync_all`, :func:`fsync_dir`, :func:`fsync_tree`.

Nothing outside this package imports its modules; they are tuned I/O (large sequential
writes, prefaulted reads, read-ahead) with their measurements in their docstrings.

Flushing to stable storage: fsync of files and directories (why: see docs/checkpoints.md).

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
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veoptim.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import StorageWriter

# torch and DCP are imported by the functions that move tensors, not here: the store's
# publication, its readers and retention (and the crash tests' writer processes) only
# need the durability below, and start without paying for torch.

log = logging.getLogger(__name__)

# DCP warns on every single-process save/load that it "assumes" one process: intended here.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

#: Byte layouts of the DCP shards (checkpoint.format): ``raw`` (veoptim's, fast; read by
#: veoptim, converted by ``veoptim-export --format dcp``) or ``dcp`` (DCP's own
#: ``torch_save`` records, readable by torch's tools). Both are read whatever is configured.
FORMAT_RAW, FORMAT_DCP = "raw", "dcp"
FORMATS = (FORMAT_RAW, FORMAT_DCP)
#: DCP names its writer threads after their target function (``Thread-1 (<target>)``).
_DCP_WRITER_TARGET = "_write_files_from_queue"


# ---------------------------------------------------------------- tensors
def tensor_writer(
    directory: Path, *, storage_format: str, fsync: bool, threads: int
) -> StorageWriter:
    """A DCP writer into ``directory``: ``threads`` shard files per rank, each fsynced by
    the thread that wrote it when ``fsync``."""
    from torch.distributed.checkpoint import FileSystemWriter

    from veoptim.checkpoint.storage.raw_writer import RawFileSystemWriter

    kind = RawFileSystemWriter if storage_format == FORMAT_RAW else FileSystemWriter
    return kind(directory, sync_files=fsync, thread_count=threads)


def save_tensors(
    tensors: Mapping[str, Any],
    writer: StorageWriter,
    *,
    group: Any = None,
    async_group: Any = None,
    asynchronous: bool = False,
    local: bool = False,
) -> Future | None:
    """Write ``tensors`` with DCP (collective on ``group``; ``local``: this process alone,
    e.g. an offline export); with ``asynchronous``, in the background on ``async_group``
    (the returned future raises the readable error). DCP raises on every rank when any
    rank's write fails: that error comes back as one ``CheckpointError`` naming each
    failing rank's cause (DCP's tracebacks stay its ``__cause__``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    quiet_writer_threads()
    try:
        if asynchronous:
            return _readable_future(
                dcp.async_save(dict(tensors), storage_writer=writer, process_group=async_group)
            )
        dcp.save(dict(tensors), storage_writer=writer, process_group=group, no_dist=local)
    except CheckpointException as exc:
        raise readable(exc) from exc
    return None


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of ``directory``, unpickled with an allow-list (no code runs)."""
    from veoptim.checkpoint.storage.safe_dcp import read_dcp_metadata

    return read_dcp_metadata(directory)


def load_tensors(
    buffers: Mapping[str, Any],
    directory: Path,
    metadata: Metadata | None = None,
    *,
    group: Any = None,
    local: bool = False,
) -> None:
    """Read the saved tensors into ``buffers`` (collective on ``group``; ``local``: this
    process alone). Keys the checkpoint holds that ``buffers`` lacks are left unread (e.g.
    the optimizer on a weights-only load): the caller compared the inventories before.
    ``metadata``: :func:`read_metadata`'s, when the caller has it (else read again)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException

    from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader

    try:
        dcp.load(
            dict(buffers),
            storage_reader=SafeFileSystemReader(directory, metadata),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            process_group=group,
            no_dist=local,
        )
    except CheckpointException as exc:
        raise readable(exc) from exc


@contextmanager
def reading_ahead(directory: Path, rank: int) -> Iterator[None]:
    """Read ``rank``'s shard files into the page cache while the block runs (a load's
    validation and planning); the reading stops when the block ends."""
    from veoptim.checkpoint.storage.readahead import ShardPrefetch

    prefetch = ShardPrefetch(directory, rank)
    try:
        yield
    finally:
        prefetch.stop()


def _readable_future(future: Future) -> Future:
    """A future that completes with ``future``, a DCP failure turned :func:`readable`."""
    from torch.distributed.checkpoint.api import CheckpointException

    relayed: Future = Future()

    def relay(done: Future) -> None:
        error = done.exception()
        if error is None:
            relayed.set_result(done.result())
        elif isinstance(error, CheckpointException):
            rewritten = readable(error)
            rewritten.__cause__ = error
            relayed.set_exception(rewritten)
        else:
            relayed.set_exception(error)

    future.add_done_callback(relay)
    return relayed


def readable(error: CheckpointException) -> CheckpointError:
    """DCP's CheckpointException as a CheckpointError naming each failing rank's own cause.

    Its text is whole tracebacks, so the agreed message (causes are cut at a few hundred
    characters) would otherwise lose the actual cause, e.g. ``ENOSPC`` on rank 1.
    """
    causes = "; ".join(
        f"rank {rank}: {_root_cause(cause)}"
        for rank, (cause, _trace) in sorted(error.failures.items())
    )
    return CheckpointError(f"DCP failed on {causes or 'an unknown rank'}")


def quiet_writer_threads() -> None:
    """Keep a failing DCP writer thread from printing its traceback before the agreed error.

    DCP re-raises a writer thread's exception (e.g. ``ENOSPC``) from ``dcp.save`` or the
    async save's future, where it becomes one readable ``CheckpointError``; the thread's
    own traceback on stderr would only bury that line. Installed once per process (the
    threads of an async save outlive ``save``); other threads' exceptions still print.
    """
    previous = threading.excepthook
    if getattr(previous, "veoptim_dcp_filter", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and _DCP_WRITER_TARGET in args.thread.name:
            log.debug("DCP writer thread %s failed: %s", args.thread.name, args.exc_value)
            return
        previous(args)

    hook.veoptim_dcp_filter = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _root_cause(error: BaseException) -> str:
    """The operating-system error behind ``error`` if there is one (a full disk surfaces in
    DCP as a zip-writer ``RuntimeError`` whose context is the ``OSError``), else ``error``."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return f"{type(cause).__name__}: {cause}"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------- durability
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
