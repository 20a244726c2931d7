"""One writer per run dir: ``<run.dir>/run.lock``.

Every writer of a run dir (a training task, ``veoptim-serve``, an export published into
it) holds an exclusive ``flock`` on ``run.lock`` for its lifetime. The kernel drops the
lock when the process ends, however it ends, so a killed holder never blocks the next run;
the file's JSON names the holder (pid, host, start time, command) for the refusal message
of a second writer and for the log line of the run that takes over a stale record.

The file is never deleted (unlinking it would let two processes lock two different
files under one name); releasing clears its contents.

What the lock cannot promise: ``flock`` is per host on local filesystems and on NFSv4 or
Lustre with locking enabled it holds across hosts, but on a filesystem mounted without lock
support (NFS ``nolock``, some FUSE filesystems) two hosts can both take it. Give jobs on
such filesystems their own run dirs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.distributed.agreement import broadcast_from_rank0, rank
from veoptim.errors import ConfigError
from veoptim.rundir.identity import RUN_FILE

LOCK_FILE = "run.lock"
log = logging.getLogger(__name__)


class RunDirInUseError(ConfigError):
    """Another process holds the run dir's lock."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run dir's lock."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def this_process(cls) -> Holder:
        command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), command)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            raw: Any = json.loads(text)
            return cls(int(raw["pid"]), str(raw["host"]), str(raw["started"]), str(raw["command"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started} ({self.command})"

    def is_alive_here(self) -> bool:
        """Whether this holder is a live process on this host (False on another host)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # exists, owned by someone else
        return True


def in_use_error(run_dir: Path, holder: Holder | None, what: str) -> RunDirInUseError:
    """The refusal a second writer of ``run_dir`` gets (the dry run says the same)."""
    who = holder.describe() if holder else "another process"
    return RunDirInUseError(
        f"run.dir {run_dir} is in use by {who}; wait for it to finish, stop it, or give "
        f"{what} another run.dir."
    )


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


class RunDirLock:
    """The held lock of one run dir; ``release`` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, run_dir: str | Path, what: str = "this run") -> RunDirLock:
        """Take ``<run_dir>/run.lock`` or raise ``RunDirInUseError`` naming its holder.

        A record left by a process that no longer holds the lock (it was killed) is taken
        over, and the log says whose it was. An unusable run dir (not a directory, not
        writable) is a ``ConfigError`` naming it.
        """
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / LOCK_FILE
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(
                f"run.dir {run_dir} cannot be used ({reason}); choose a run.dir that is a "
                "writable directory (or can be created)."
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.parse(_read(fd))
            os.close(fd)
            raise in_use_error(run_dir, holder, what) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(
                f"run.dir {run_dir}: cannot lock {path} ({exc.strerror}); the filesystem may "
                "not support locks: use a run.dir on a local or lock-capable filesystem."
            ) from exc
        previous = Holder.parse(_read(fd))
        if previous is not None:
            state = "still running (pid reused?)" if previous.is_alive_here() else "gone"
            log.warning(
                "run.dir %s: took over the stale lock of %s, which is %s and no longer "
                "holds it", run_dir, previous.describe(), state,
            )  # fmt: skip
        lock = cls(path, fd)
        lock._record(Holder.this_process())
        return lock

    def _record(self, holder: Holder) -> None:
        data = json.dumps(holder.__dict__).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Clear the record and unlock (idempotent)."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_of(run_dir: str | Path) -> Holder | None:
    """Who holds ``run_dir``'s lock now (None: nobody), without taking it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return Holder.parse(_read(fd)) or Holder(0, "?", "?", "unknown")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def run_dir_problem(run_dir: str | Path) -> str | None:
    """Why ``run_dir`` cannot be a run dir (one sentence), or None: it is a directory, or
    can be created, and is writable. Checked before anything is written (Hydra's own log
    file included)."""
    path = Path(run_dir).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is not a directory)"
        return (
            f"run.dir {run_dir} cannot be used: it is not a directory{where}; choose a directory."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"run.dir {run_dir} cannot be used: {existing} is not writable; choose a writable directory."
    return None


def owning_run_dir(path: str | Path) -> Path | None:
    """The run dir ``path`` (an export root such as ``<run.dir>/exports``) lies in: ``path``
    or its parent when it holds a run record or lock; None elsewhere."""
    path = Path(path).absolute()
    for candidate in (path, path.parent):
        if (candidate / LOCK_FILE).exists() or (candidate / RUN_FILE).exists():
            return candidate
    return None


@contextmanager
def locked_run_dir(
    run_dir: str | Path, what: str = "this run", group: Any = None
) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block: rank 0 takes it, every rank of ``group``
    learns the outcome, and if rank 0 was refused every rank raises the same error (so no
    rank trains alone and none waits for a peer that gave up)."""
    lock: RunDirLock | None = None
    refusal: tuple[bool, str] | None = None
    if rank(group) == 0:
        try:
            lock = RunDirLock.acquire(run_dir, what)
        except Exception as exc:  # every rank must hear of it, whatever it is
            refusal = (isinstance(exc, RunDirInUseError), str(exc))
    refusal = broadcast_from_rank0(refusal, group)
    if refusal is not None:
        in_use, message = refusal
        raise (RunDirInUseError if in_use else ConfigError)(message)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
