"""The versioned-directory store that checkpoints, exports and slots share: crash-atomic
publication of versions under names and retention.
It is the one caller of the DCP storage's durability (``storage.fsync_*``).

    publisher = Publisher(root, keep_last=3, fsync=True, group=None)
    with publisher.write("step_00000100", step=100) as version_dir:
        ...  # every rank writes its files into version_dir

or, when the caller writes in stages of its own, or in the background (``dcp.async_save``)::

    pending = publisher.begin("step_00000100", step=100)   # collective: prepare
    with pending.agreed("gathering state"):                # a stage, ending in agreement
        ...
    pending.write_files({pending.path / "a.json": data})   # small files, noted and flushed
    pending.finish(error_or_none)                           # collective: publish

A save is one sequence of phases, run by ``PendingVersion._begin`` and
``PendingVersion.finish`` and implemented by the ``_prepare`` ... ``_retain`` methods below
them, in this order:

1. prepare (rank 0): refuse a legacy directory, clean debris, create the version directory;
2. write (every rank): the caller's files, then fsync of the files this rank can see
   (skipped when the caller says its writers already flushed them: ``files_flushed``);
3. manifest (rank 0): written last, listing every other file;
4. flush (rank 0): fsync of the manifest, every directory of the version and ``.versions``,
   concurrently (one merged device flush: see ``storage``);
5. point (rank 0): a temporary relative symlink ``os.replace``-d over the name, fsync of
   the root; rolled back if anything fails after the replace;
6. retain (rank 0, best-effort): ``keep_last`` and cleanup; never fails the save.

Phases 1, 2 and 3-5 each end in a cross-rank agreement, so every rank raises the same
``CheckpointError``. A failure leaves the previous version of the name published and
removes the new, unpublished version directory. ``faults.PHASES`` names the points where
tests inject faults.

Retention and crash-debris cleanup are best-effort: failures are logged, never raised.

* ``prune_names`` unlinks the oldest prunable names beyond ``keep_last`` (a name counts only
  if it is the name its version was first published under; a second link made by hand is
  never pruned).
* ``collect_garbage`` removes temporary links and versions that no name points to. Entries
  in ``protected`` (saves in flight, the version a save just moved its name away from) and
  versions any name points to are never touched.

Deleting a version unlinks its manifest first, so a half-deleted version is never taken
for a complete one.

The points where tests inject faults (``fault_hook``) are named in ``faults.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from veoptim.checkpoint import storage
from veoptim.checkpoint.faults import (
    PHASE_AFTER_MANIFEST,
    PHASE_AFTER_REPLACE,
    PHASE_BEFORE_MANIFEST,
    PHASE_BEFORE_REPLACE,
    PHASE_PREPARED,
    PHASE_RETENTION,
    PHASE_WRITTEN,
    FaultHook,
)
from veoptim.checkpoint.layout import (
    KIND_CHECKPOINT,
    Manifest,
    build_manifest,
    is_temp_link_name,
    is_version_id,
    link_path,
    link_target,
    manifest_path,
    new_version_id,
    published_names,
    read_link,
    read_manifest,
    scan_tree,
    temp_link_path,
    validate_name,
    version_dir,
    versions_dir,
    write_manifest,
)
from veoptim.distributed.agreement import (
    agree,
    agreed,
    broadcast_from_rank0,
    rank,
    world_size,
)
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)
T = TypeVar("T")


def fire(hook: FaultHook | None, phase: str) -> None:
    """Call ``hook`` with ``phase`` (a name of ``faults.py``) if a hook is set (tests only)."""
    if hook is not None:
        hook(phase)


# ---------------------------------------------------------------- publication


def _refuse_legacy(link: Path) -> None:
    """A plain directory under a name (e.g. a checkpoint copied with ``cp -r``, which turns
    the link into a directory) may be the only copy of that checkpoint: never replace it."""
    if os.path.lexists(link) and not link.is_symlink():
        raise CheckpointError(
            f"Checkpoint name {link.name!r} in {link.parent} is a plain directory (a legacy "
            f"checkpoint, or one copied without its symlinks) and is never overwritten; it "
            f"stays readable, save under a new name."
        )


@dataclass(frozen=True)
class Published:
    """A successful publication: ``name`` now points to ``path``."""

    name: str
    path: Path
    manifest: Manifest
    previous: str | None  # version id the name pointed to before, if any


class Publisher:
    """Publishes versions under names in one checkpoint root (see the module docstring).

    ``group``: the process group whose ranks write together (None = default group, or a
    single process). ``keep_last``: how many prunable names of a kind to keep (0 = all).
    ``run``: the run id every version it publishes records; retention then counts and
    prunes only that run's names (another run's names in the root are kept).
    ``fault_hook``: called with each phase name (``PHASES``); tests inject faults with it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int = 0,
        fsync: bool = True,
        group: Any = None,
        run: str | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if keep_last < 0:
            raise CheckpointError(f"keep_last must be >= 0 (0 = keep all), got {keep_last}.")
        self.root = Path(root)
        self.keep_last, self.fsync, self.group = keep_last, fsync, group
        self.run = run
        self.fault_hook = fault_hook

    @property
    def is_rank0(self) -> bool:
        return rank(self.group) == 0

    def under(self, name: str) -> Publisher:
        """This store's options for the root ``<root>/<name>``: a root of its own (its
        names, versions and retention), e.g. one per slot checkpoint name."""
        return Publisher(
            self.root / validate_name(name),
            keep_last=self.keep_last,
            fsync=self.fsync,
            group=self.group,
            run=self.run,
            fault_hook=self.fault_hook,
        )

    def begin(
        self,
        name: str,
        *,
        kind: str = KIND_CHECKPOINT,
        step: int | None = None,
        prunable: bool = True,
    ) -> PendingVersion:
        """Prepare (collective): a fresh, empty version directory for ``name``.

        ``kind`` separates checkpoints from exports (``latest_complete`` and retention look
        at one kind); ``prunable=False`` exempts the name from ``keep_last``.
        """
        pending = PendingVersion(self, validate_name(name), kind=kind, step=step, prunable=prunable)
        pending._begin()
        return pending

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


class PendingVersion:
    """A version being written; every rank must call ``finish`` (or commit/abort) once."""

    def __init__(
        self, publisher: Publisher, name: str, *, kind: str, step: int | None, prunable: bool
    ) -> None:
        self.publisher = publisher
        self.root = publisher.root
        self.name = name
        self.kind, self.step, self.prunable = kind, step, prunable
        self.version_id = ""  # set by _begin(), on every rank
        self._key = root_key(self.root)
        self._written_sha256: dict[str, str] = {}
        self._finished = False

    @property
    def path(self) -> Path:
        return version_dir(self.root, self.version_id)

    # ------------------------------------------------------------------ the sequence
    def _begin(self) -> None:
        """Phase 1 (collective): rank 0 prepares the version, every rank learns its id."""
        pub = self.publisher

        def prepare() -> None:
            if pub.is_rank0:
                self._prepare()
            fire(pub.fault_hook, PHASE_PREPARED)

        self._agreed(f"checkpoint {self.name!r} prepare in {self.root}", prepare)
        self.version_id = broadcast_from_rank0(self.version_id, pub.group)

    def finish(self, error: BaseException | None, *, files_flushed: bool = False) -> Published:
        """Phases 2-6 (collective): write, manifest, flush, point; then retain on rank 0.

        ``error``: this rank's failure to write its files (None if they are all written).
        ``files_flushed``: this rank's writers fsynced every file they wrote (the checkpointer:
        DCP's writer and its own JSON), so phase 2 need not fsync them again: every fsync
        costs a device flush even on a clean file.
        """
        if self._finished:
            raise CheckpointError(f"Checkpoint version {self.path} was already finished.")
        self._finished = True
        pub, what = self.publisher, f"checkpoint {self.name!r}"
        self._agreed(
            f"{what} write into {self.path}", lambda: self._write(files_flushed), error=error
        )

        def publish() -> Published:  # rank 0
            manifest, dirs = self._write_manifest()
            self._flush(dirs)
            previous = self._point()
            return Published(self.name, self.path.resolve(), manifest, previous=previous)

        published = self._agreed(f"{what} publish of {self.path}", publish, rank0_only=True)
        published = broadcast_from_rank0(published, pub.group)
        if pub.is_rank0:
            unregister(self._key, self.version_id)
            self._retain(published)
        return published

    @contextmanager
    def agreed(self, what: str) -> Iterator[None]:
        """A caller's stage of the write (gathering state, creating a writer, ...) on every
        rank, ending in agreement: if any rank fails, the version is removed and every rank
        raises the same ``CheckpointError``, so no rank goes on into a collective alone."""
        try:
            with agreed(f"checkpoint {self.name!r} {what}", self.publisher.group):
                yield
        except CheckpointError:
            self._finished = True
            self._remove()
            raise

    def write_files(self, files: Mapping[Path, bytes]) -> None:
        """Write these small files of this rank into the version (parents created), note
        their bytes for the manifest and, with ``fsync``, flush them together."""
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        self.note_written(files)
        if self.publisher.fsync:
            storage.fsync_all(list(files))

    def note_written(self, files: Mapping[Path, bytes]) -> None:
        """This rank wrote exactly these bytes to these files of the version: on rank 0 the
        manifest takes their checksums from them instead of reading the files back."""
        for path, data in files.items():
            rel = Path(path).relative_to(self.path).as_posix()
            self._written_sha256[rel] = hashlib.sha256(data).hexdigest()

    def commit(self) -> Published:
        return self.finish(None)

    def abort(self, error: BaseException) -> None:
        """Report this rank's write failure; raises the agreed ``CheckpointError``."""
        self.finish(error)

    # ------------------------------------------------------------------ the phases, in order
    def _prepare(self) -> None:
        """Rank 0: make ``.versions``, refuse a legacy name, clean debris, create the version."""
        pub, versions = self.publisher, versions_dir(self.root)
        if not versions.is_dir():
            versions.mkdir(parents=True, exist_ok=True)
            if pub.fsync:
                storage.fsync_dir(self.root)  # .versions must outlive a power loss before any name
        _refuse_legacy(link_path(self.root, self.name))
        try:
            collect_garbage(self.root, protected=in_flight(self._key))
        except Exception as exc:  # cleanup never fails a save
            log.warning("Checkpoint cleanup in %s failed (ignored): %s", self.root, exc)
        version_id = new_version_id(self.name)
        register(self._key, version_id)
        try:
            version_dir(self.root, version_id).mkdir()
        except BaseException:
            unregister(self._key, version_id)
            raise
        self.version_id = version_id

    def _write(self, files_flushed: bool) -> None:
        """Every rank, after its writes: flush every file it can see in the version, unless
        its writers already did (then every file is flushed by the rank that wrote it)."""
        fire(self.publisher.fault_hook, PHASE_WRITTEN)
        if self.publisher.fsync and not files_flushed:
            storage.fsync_tree(self.path, files=True, dirs=False)

    def _write_manifest(self) -> tuple[Manifest, list[str]]:
        """Rank 0: the manifest, last, describing every file all ranks wrote; returns it and
        the version's directories."""
        pub = self.publisher
        fire(pub.fault_hook, PHASE_BEFORE_MANIFEST)
        files, dirs = scan_tree(self.path)
        manifest = build_manifest(
            self.path,
            name=self.name,
            kind=self.kind,
            step=self.step,
            world_size=world_size(pub.group),
            prunable=self.prunable,
            run=pub.run,
            files=files,
            known_sha256=self._written_sha256,
        )
        write_manifest(self.path, manifest)  # flushed by _flush, with the directories
        return manifest, dirs

    def _flush(self, dirs: list[str]) -> None:
        """Rank 0: the manifest and every directory entry of the version (``dirs``) are
        durable before the name moves (one concurrent batch: the flushes merge)."""
        pub = self.publisher
        if pub.fsync:  # the manifest, every directory, the version's entry in .versions
            storage.fsync_all(
                files=[manifest_path(self.path)], dirs=[*dirs, versions_dir(self.root)]
            )
        fire(pub.fault_hook, PHASE_AFTER_MANIFEST)

    def _point(self) -> str | None:
        """Rank 0: atomically point the name at the version; return the previous version id.

        Rolled back to the previous version if anything fails after the replace.
        """
        pub, link = self.publisher, link_path(self.root, self.name)
        _refuse_legacy(link)  # a directory may have appeared since prepare
        try:
            previous = read_link(self.root, self.name)
        except CheckpointError:
            previous = None  # a malformed link is replaced like any other
        tmp = temp_link_path(self.root, self.name, uuid.uuid4().hex[:16])
        register(self._key, tmp.name)
        try:
            os.symlink(link_target(self.version_id), tmp)
            fire(pub.fault_hook, PHASE_BEFORE_REPLACE)
            os.replace(tmp, link)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        finally:
            unregister(self._key, tmp.name)
        try:
            fire(pub.fault_hook, PHASE_AFTER_REPLACE)
            if pub.fsync:
                storage.fsync_dir(self.root)
        except BaseException as exc:
            self._roll_back(previous, exc)
            raise
        return previous

    def _roll_back(self, previous: str | None, cause: BaseException) -> None:
        link = link_path(self.root, self.name)
        try:
            if previous is None:
                link.unlink()
            else:
                tmp = temp_link_path(self.root, self.name, uuid.uuid4().hex[:16])
                os.symlink(link_target(previous), tmp)
                os.replace(tmp, link)
        except OSError as exc:
            msg = "Rolling %s back after %r failed (%s); it points to the new version."
            log.error(msg, link, cause, exc)

    def _retain(self, published: Published) -> None:
        """Rank 0, best-effort: prune beyond ``keep_last``, then collect what that pruning
        left unreferenced (this save's prepare already collected all earlier debris). The
        version the name moved away from stays until the next save: readers may still be
        in it."""
        pub = self.publisher
        try:
            pruned = prune_names(
                self.root,
                keep_last=pub.keep_last,
                kind=self.kind,
                keep_name=self.name,
                run=pub.run,
                fault_hook=pub.fault_hook,
            )
            if not pruned:  # prepare collected everything else this save could leave
                return
            protected = in_flight(self._key)
            if published.previous is not None:
                protected.add(published.previous)
            collect_garbage(self.root, protected=protected, fault_hook=pub.fault_hook)
        except Exception as exc:
            log.warning("Checkpoint retention in %s failed (ignored): %s", self.root, exc)

    # ------------------------------------------------------------------ agreeing, giving up
    def _agreed(
        self,
        what: str,
        step: Callable[[], T],
        *,
        error: BaseException | None = None,
        rank0_only: bool = False,
    ) -> T | None:
        """Run ``step`` on this rank (unless it already failed with ``error``), then agree on
        the outcome across ranks (see :meth:`_agree`)."""
        outcome: bool | BaseException = True if error is None else error
        result = None
        if error is None and (self.publisher.is_rank0 or not rank0_only):
            try:
                result = step()
            except Exception as exc:
                outcome = exc
        self._agree(outcome, what)
        return result

    def _agree(self, outcome: bool | BaseException, what: str) -> None:
        """Agree on this rank's outcome; if any rank failed, remove the version and raise
        the agreed ``CheckpointError`` (the same on every rank)."""
        try:
            agree(outcome, what, self.publisher.group)
        except CheckpointError:
            self._remove()
            raise

    def discard(self) -> None:
        """Give up without agreement (training failed, peers may be gone): never published;
        rank 0 removes the directory now, other ranks' leftovers go at the next save."""
        self._finished = True
        self._remove()

    def _remove(self) -> None:
        """Rank 0: remove this unpublished version (best-effort; never a published one)."""
        if not self.publisher.is_rank0 or not self.version_id:
            return
        try:
            if read_link(self.root, self.name) != self.version_id:
                remove_version(self.path)
        except (OSError, CheckpointError) as exc:
            log.warning("Could not remove unpublished checkpoint %s: %s", self.path, exc)
        finally:
            unregister(self._key, self.version_id)


# ---------------------------------------------------------------- retention and cleanup (best-effort)


def remove_version(version: Path) -> None:
    """Delete a version: manifest first (it stops being complete), then the rest."""
    try:
        manifest_path(version).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(version)


def remove_root(root: Path) -> None:
    """Delete a checkpoint root and every version in it: all manifests first (no reader
    takes a half-deleted version for a complete one), then each version, then the rest
    (names, debris). Nothing there: nothing to do."""
    root = Path(root)
    try:
        versions = sorted(e for e in os.listdir(versions_dir(root)) if is_version_id(e))
    except FileNotFoundError:
        versions = []
    for entry in versions:
        with suppress(FileNotFoundError):
            manifest_path(version_dir(root, entry)).unlink()
    for entry in versions:
        with suppress(FileNotFoundError):
            shutil.rmtree(version_dir(root, entry))
    with suppress(FileNotFoundError):
        shutil.rmtree(root)


def unpublish(root: Path, name: str) -> bool:
    """Delete published name ``name`` of ``root`` and the version it points to (manifest
    first, then the name, then the files); False when ``name`` is not published there."""
    version_id = read_link(Path(root), name)
    if version_id is None:
        return False
    version = version_dir(Path(root), version_id)
    with suppress(FileNotFoundError):
        manifest_path(version).unlink()
    with suppress(FileNotFoundError):
        link_path(Path(root), name).unlink()
    with suppress(FileNotFoundError):
        shutil.rmtree(version)
    return True


def collect_garbage(
    root: Path,
    *,
    protected: Collection[str] = (),
    fault_hook: FaultHook | None = None,
) -> list[Path]:
    """Remove unreferenced versions and stray temporary links; return what was removed.

    ``protected`` holds entry names (version ids, temporary link names) to keep.
    """
    root = Path(root)
    removed: list[Path] = []
    try:
        for entry in os.listdir(root):
            if is_temp_link_name(entry) and entry not in protected:
                _best_effort((root / entry).unlink, root / entry, removed)
    except OSError as exc:
        log.warning("Checkpoint cleanup could not list %s: %s", root, exc)
        return removed
    referenced = set(published_names(root).values())
    try:
        entries = sorted(os.listdir(versions_dir(root)))
    except OSError:
        return removed
    for entry in entries:
        if not is_version_id(entry) or entry in referenced or entry in protected:
            continue
        path = version_dir(root, entry)
        fire(fault_hook, PHASE_RETENTION)
        _best_effort(lambda p=path: remove_version(p), path, removed)
    return removed


def _best_effort(action: Callable[[], None], path: Path, removed: list[Path]) -> None:
    try:
        action()
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("Checkpoint cleanup could not remove %s (ignored): %s", path, exc)


def _prunable(root: Path, kind: str, run: str | None) -> list[tuple[tuple[int, int], str]]:
    out = []
    for name, version_id in published_names(root).items():
        try:
            manifest: Manifest = read_manifest(version_dir(root, version_id))
        except CheckpointError:
            continue
        if run is not None and manifest.run != run:
            continue  # another run's name (kept after checkpoint.overwrite): never pruned
        if manifest.kind == kind and manifest.prunable and manifest.name == name:
            step = -1 if manifest.step is None else manifest.step
            out.append(((step, manifest.created_ns), name))
    return sorted(out)


def prune_names(
    root: Path,
    *,
    keep_last: int,
    kind: str,
    keep_name: str,
    run: str | None = None,
    fault_hook: FaultHook | None = None,
) -> list[str]:
    """Unlink the oldest prunable ``kind`` names beyond ``keep_last`` (never ``keep_name``);
    with ``run``, only that run's names count and go.

    Only the names go; their versions, now unreferenced, go with ``collect_garbage``.
    """
    if keep_last <= 0:
        return []
    everything = _prunable(Path(root), kind, run)
    candidates = [name for _, name in everything if name != keep_name]
    excess = len(everything) - keep_last
    pruned: list[str] = []
    for name in candidates[: max(excess, 0)]:
        fire(fault_hook, PHASE_RETENTION)
        try:
            (Path(root) / name).unlink()
        except OSError as exc:
            log.warning("Checkpoint retention could not unlink %s (ignored): %s", name, exc)
            continue
        pruned.append(name)
    return pruned


# ---------------------------------------------------------------- saves in flight in this process
# The entries (version ids, temporary link names) of saves in flight in this process.
#
# Keyed by the real path of their checkpoint root, so cleanup run by another ``Publisher``
# on the same root (however its path is spelled) never deletes what a save is still
# writing.
_ENTRIES: dict[str, set[str]] = {}
_LOCK = threading.Lock()


def root_key(root: Path) -> str:
    """The registry's key for ``root``: its real path (resolve once per save: each resolve
    is a walk of ``lstat`` calls)."""
    return str(Path(root).resolve())


def register(key: str, entry: str) -> None:
    with _LOCK:
        _ENTRIES.setdefault(key, set()).add(entry)


def unregister(key: str, entry: str) -> None:
    with _LOCK:
        _ENTRIES.get(key, set()).discard(entry)


def in_flight(key: str) -> set[str]:
    """A copy of the entries in flight under the root ``key``."""
    with _LOCK:
        return set(_ENTRIES.get(key, ()))
