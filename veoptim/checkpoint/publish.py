"""Crash-atomic publication of checkpoint versions, used by every writer (SPEC §5.5).

    publisher = Publisher(root, keep_last=3, fsync=True, group=None)
    with publisher.write("step_00000100", step=100) as version_dir:
        ...  # every rank writes its files into version_dir

or, when the files are written in the background (``dcp.async_save``)::

    pending = publisher.begin("step_00000100", step=100)   # collective
    ...                                                     # write into pending.path
    pending.finish(error_or_none)                           # collective: agree, publish

Phases, each ending in a cross-rank agreement (same ``CheckpointError`` on every rank):
prepare (rank 0: validate, refuse legacy directories, clean debris, create the version
directory, broadcast its id) -> write (every rank; then fsync of the files each rank can
see) -> publish (rank 0: manifest last, fsync, temporary relative symlink, ``os.replace``
over the name, fsync of the root; rolled back if a step after the replace fails). Then,
best-effort on rank 0, retention. A failure in any phase leaves the previous version of
the name published and removes the new, unpublished version directory.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.checkpoint.durable import fsync_dir, fsync_tree
from veoptim.checkpoint.layout import (
    link_path,
    link_target,
    new_version_id,
    temp_link_path,
    validate_name,
    version_dir,
    versions_dir,
)
from veoptim.checkpoint.manifest import KIND_CHECKPOINT, Manifest, build_manifest, write_manifest
from veoptim.checkpoint.resolve import check_complete, read_link
from veoptim.checkpoint.retention import (
    PHASE_RETENTION,
    collect_garbage,
    in_flight,
    prune_names,
    register_in_flight,
    remove_version,
    retire,
    unregister_in_flight,
)
from veoptim.distributed.agreement import agree, broadcast_from_rank0, rank, world_size
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)

PHASE_PREPARED = "prepared"  # every rank, after the version directory exists
PHASE_WRITTEN = "written"  # every rank, after the caller's writes, before fsync
PHASE_BEFORE_MANIFEST = "before_manifest"  # rank 0
PHASE_AFTER_MANIFEST = "after_manifest"  # rank 0, manifest durable, name not yet moved
PHASE_BEFORE_REPLACE = "before_replace"  # rank 0, temporary link exists
PHASE_AFTER_REPLACE = "after_replace"  # rank 0, name points to the new version
PHASES = (
    PHASE_PREPARED,
    PHASE_WRITTEN,
    PHASE_BEFORE_MANIFEST,
    PHASE_AFTER_MANIFEST,
    PHASE_BEFORE_REPLACE,
    PHASE_AFTER_REPLACE,
    PHASE_RETENTION,
)
FaultHook = Callable[[str], None]


@dataclass(frozen=True)
class Published:
    """A successful publication: ``name`` now points to ``path``."""

    name: str
    path: Path
    manifest: Manifest
    previous: str | None  # version id the name pointed to before, if any


def _legacy_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint name {path.name!r} in {path.parent} is a plain directory (a legacy "
        f"checkpoint) and is never overwritten; it stays readable, save under a new name."
    )


class PendingVersion:
    """A version being written; every rank must call ``finish`` (or commit/abort) once."""

    def __init__(
        self,
        publisher: Publisher,
        name: str,
        version_id: str,
        *,
        kind: str,
        step: int | None,
        prunable: bool,
        metadata: dict[str, Any] | None,
    ) -> None:
        self.publisher = publisher
        self.name = name
        self.version_id = version_id
        self.path = version_dir(publisher.root, version_id)
        self.kind, self.step, self.prunable = kind, step, prunable
        self.metadata = dict(metadata or {})
        self._finished = False

    def commit(self) -> Published:
        return self.finish(None)

    def abort(self, error: BaseException) -> None:
        """Report this rank's write failure; raises the agreed ``CheckpointError``."""
        self.finish(error)

    def finish(self, error: BaseException | None) -> Published:
        """Agree on the write, publish on rank 0, agree again, then retention (rank 0)."""
        if self._finished:
            raise CheckpointError(f"Checkpoint version {self.path} was already finished.")
        self._finished = True
        pub = self.publisher
        outcome: bool | BaseException = True if error is None else error
        if error is None:
            try:
                pub._hook(PHASE_WRITTEN)
                if pub.fsync:
                    fsync_tree(self.path, files=True, dirs=False)
            except Exception as exc:
                outcome = exc
        try:
            agree(outcome, f"checkpoint {self.name!r} write into {self.path}", pub.group)
        except CheckpointError:
            self._discard()
            raise
        outcome, result = True, None
        if pub.is_rank0:
            try:
                result = pub._publish(self)
            except Exception as exc:
                outcome = exc
        try:
            agree(outcome, f"checkpoint {self.name!r} publish of {self.path}", pub.group)
        except CheckpointError:
            self._discard()
            raise
        result = broadcast_from_rank0(result, pub.group)
        if pub.is_rank0:
            unregister_in_flight(pub.root, self.version_id)
            pub._retention(result)
        return result

    def discard(self) -> None:
        """Give up without agreement (training failed, peers may be gone): never published;
        rank 0 removes the directory now, other ranks' leftovers go at the next save."""
        self._finished = True
        self._discard()

    def _discard(self) -> None:
        """Rank 0: remove this unpublished version (best-effort; never a published one)."""
        pub = self.publisher
        if not pub.is_rank0:
            return
        try:
            if read_link(pub.root, self.name) != self.version_id:
                remove_version(self.path)
        except (OSError, CheckpointError) as exc:
            log.warning("Could not remove unpublished checkpoint %s: %s", self.path, exc)
        finally:
            unregister_in_flight(pub.root, self.version_id)


class Publisher:
    """Publishes versions under names in one checkpoint root (see the module docstring).

    ``group``: the process group whose ranks write together (None = default group, or a
    single process). ``grace_s``: how long a version stays on disk after no name points
    to it any more (it always survives until the next save begins). ``fault_hook``: called
    with each phase name (``PHASES``) at that point; tests use it to inject crashes/faults.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int = 0,
        fsync: bool = True,
        group: Any = None,
        grace_s: float = 0.0,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if keep_last < 0:
            raise CheckpointError(f"keep_last must be >= 0 (0 = keep all), got {keep_last}.")
        self.root = Path(root)
        self.keep_last, self.fsync, self.group = keep_last, fsync, group
        self.grace_s, self.fault_hook = grace_s, fault_hook

    @property
    def is_rank0(self) -> bool:
        return rank(self.group) == 0

    def _hook(self, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase)

    def begin(
        self,
        name: str,
        *,
        kind: str = KIND_CHECKPOINT,
        step: int | None = None,
        prunable: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> PendingVersion:
        """Prepare phase (collective): a fresh, empty version directory for ``name``.

        ``kind`` separates checkpoints from exports (``latest_complete`` and retention look
        at one kind); ``prunable=False`` exempts the name from ``keep_last``.
        """
        validate_name(name)
        outcome: bool | BaseException = True
        version_id: str | None = None
        try:
            if self.is_rank0:
                version_id = self._prepare(name)
            self._hook(PHASE_PREPARED)
        except Exception as exc:
            outcome = exc
        try:
            agree(outcome, f"checkpoint {name!r} prepare in {self.root}", self.group)
        except CheckpointError:
            if version_id is not None:
                with suppress(OSError):
                    remove_version(version_dir(self.root, version_id))
                unregister_in_flight(self.root, version_id)
            raise
        version_id = broadcast_from_rank0(version_id, self.group)
        return PendingVersion(
            self, name, version_id, kind=kind, step=step, prunable=prunable, metadata=metadata
        )

    @contextmanager
    def write(self, name: str, **options: Any) -> Iterator[Path]:
        """``begin`` + yield the version directory + ``finish`` (options as for ``begin``)."""
        pending = self.begin(name, **options)
        try:
            yield pending.path
        except BaseException as exc:
            if isinstance(exc, Exception):
                pending.abort(exc)  # raises the agreed CheckpointError
            with suppress(CheckpointError):  # KeyboardInterrupt, SystemExit: keep them
                pending.abort(exc)
            raise
        pending.commit()

    def _prepare(self, name: str) -> str:
        link = link_path(self.root, name)
        if not versions_dir(self.root).is_dir():
            versions_dir(self.root).mkdir(parents=True, exist_ok=True)
            if self.fsync:
                fsync_dir(self.root)  # .versions must outlive a power loss before any name
        if os.path.lexists(link) and not link.is_symlink():
            raise _legacy_error(link)
        try:
            collect_garbage(self.root, protected=in_flight(self.root), grace_s=self.grace_s)
        except Exception as exc:  # cleanup never fails a save
            log.warning("Checkpoint cleanup in %s failed (ignored): %s", self.root, exc)
        version_id = new_version_id(name)
        register_in_flight(self.root, version_id)
        try:
            version_dir(self.root, version_id).mkdir()
        except BaseException:
            unregister_in_flight(self.root, version_id)
            raise
        return version_id

    def _publish(self, pending: PendingVersion) -> Published:
        """Rank 0: manifest last, flush, then atomically point the name at the version."""
        path, name = pending.path, pending.name
        self._hook(PHASE_BEFORE_MANIFEST)
        if self.fsync:
            fsync_tree(path, files=False, dirs=True)
        manifest = build_manifest(
            path,
            name=name,
            kind=pending.kind,
            step=pending.step,
            world_size=world_size(self.group),
            prunable=pending.prunable,
            metadata=pending.metadata,
        )
        write_manifest(path, manifest, fsync=self.fsync)
        if self.fsync:
            fsync_dir(path)  # the manifest's entry
            fsync_dir(versions_dir(self.root))  # the version directory's entry
        self._hook(PHASE_AFTER_MANIFEST)
        previous = self._point(name, pending.version_id)
        return Published(name=name, path=path.resolve(), manifest=manifest, previous=previous)

    def _point(self, name: str, version_id: str) -> str | None:
        """Atomically make ``name`` point to ``version_id``; roll back if a later step fails."""
        link = link_path(self.root, name)
        if os.path.lexists(link) and not link.is_symlink():
            raise _legacy_error(link)
        try:
            previous = read_link(self.root, name)
        except CheckpointError:
            previous = None  # a malformed link is replaced like any other
        tmp = temp_link_path(self.root, name, uuid.uuid4().hex[:16])
        register_in_flight(self.root, tmp.name)
        try:
            os.symlink(link_target(version_id), tmp)
            self._hook(PHASE_BEFORE_REPLACE)
            os.replace(tmp, link)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        finally:
            unregister_in_flight(self.root, tmp.name)
        try:
            self._hook(PHASE_AFTER_REPLACE)
            if self.fsync:
                fsync_dir(self.root)
        except BaseException as exc:
            self._roll_back(name, previous, exc)
            raise
        if previous is not None and previous != version_id:
            retire(version_dir(self.root, previous))
        return previous

    def _roll_back(self, name: str, previous: str | None, cause: BaseException) -> None:
        link = link_path(self.root, name)
        try:
            if previous is None:
                link.unlink()
            else:
                tmp = temp_link_path(self.root, name, uuid.uuid4().hex[:16])
                os.symlink(link_target(previous), tmp)
                os.replace(tmp, link)
        except OSError as exc:
            log.error(
                "Rolling %s back after %r failed (%s); it points to the new version.",
                link,
                cause,
                exc,
            )

    def alias(self, name: str, existing: str) -> Path:
        """Point ``name`` at the version ``existing`` points to (collective; e.g. ``best``)."""
        validate_name(name)
        outcome: bool | BaseException = True
        try:
            if self.is_rank0:
                version_id = read_link(self.root, existing)
                if version_id is None:
                    raise CheckpointError(
                        f"Cannot alias {name!r} to {existing!r} in {self.root}: {existing!r} "
                        f"is not a published checkpoint link."
                    )
                check_complete(version_dir(self.root, version_id))
                self._point(name, version_id)
        except Exception as exc:
            outcome = exc
        agree(outcome, f"checkpoint alias {name!r} -> {existing!r} in {self.root}", self.group)
        return (self.root / name).resolve()

    def _retention(self, published: Published) -> None:
        """Best-effort, rank 0: prune beyond ``keep_last``, then collect garbage."""
        try:
            prune_names(
                self.root,
                keep_last=self.keep_last,
                kind=published.manifest.kind,
                keep_name=published.name,
                fault_hook=self.fault_hook,
            )
            protected = set(in_flight(self.root))
            if published.previous is not None:
                protected.add(published.previous)  # readers may still be in it
            collect_garbage(
                self.root, protected=protected, grace_s=self.grace_s, fault_hook=self.fault_hook
            )
        except Exception as exc:
            log.warning("Checkpoint retention in %s failed (ignored): %s", self.root, exc)


__all__ = [
    "PHASES",
    "Publisher",
    "PendingVersion",
    "Published",
]
