"""Publication: a version written, then published under a name, crash-atomically, through
the version store's storage seam (docs/checkpoints.md, "Publishing").

    publisher = Publisher(root, keep_last=3, fsync=True, group=None)
    with publisher.write("step_00000100", step=100) as version_dir:
        ...  # every rank writes its files into version_dir

or, when the caller writes in stages of its own, or in the background (``dcp.async_save``)::

    pending = publisher.begin("step_00000100", step=100)   # collective: prepare
    with pending.agreed("gathering state"):                # a stage, ending in agreement
        ...
    pending.write_files({pending.path / "a.json": data})   # small files, noted and flushed
    pending.finish(error_or_none)                           # collective: publish

The phases (prepare, write, manifest, flush, point, retain; docs/checkpoints.md) read top
to bottom below; a failure leaves the name on its previous version and every rank raises
the same ``CheckpointError``. Every change to the root goes through the storage seam
(``disk.StoreFiles``), which a ``fault_hook`` wraps (``faults.with_faults``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from veoptim.checkpoint import disk, faults, layout
from veoptim.checkpoint.disk import LocalFiles, StoreFiles
from veoptim.checkpoint.layout import Manifest
from veoptim.distributed.agreement import agree, agreed, broadcast_from_rank0, rank, world_size
from veoptim.errors import CheckpointError

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    prunes only that run's names (another run's names in the root are kept). ``files``:
    the storage seam (default: the local filesystem, flushed when ``fsync``).
    ``fault_hook``: called with each phase name (``faults.PHASES``); tests inject faults.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int = 0,
        fsync: bool = True,
        group: Any = None,
        run: str | None = None,
        fault_hook: faults.FaultHook | None = None,
        files: StoreFiles | None = None,
    ) -> None:
        if keep_last < 0:
            raise CheckpointError(f"keep_last must be >= 0 (0 = keep all), got {keep_last}.")
        self.root = Path(root)
        self.keep_last, self.fsync, self.group = keep_last, fsync, group
        self.run = run
        self.base_files: StoreFiles = LocalFiles(fsync=fsync) if files is None else files
        self.fault_hook = fault_hook

    @property
    def fault_hook(self) -> faults.FaultHook | None:
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: faults.FaultHook | None) -> None:
        self._fault_hook = hook
        self.files = self.base_files if hook is None else faults.with_faults(self.base_files, hook)

    @property
    def is_rank0(self) -> bool:
        return rank(self.group) == 0

    def under(self, name: str) -> Publisher:
        """This store's options for the root ``<root>/<name>``: a root of its own (its
        names, versions and retention), e.g. one per slot checkpoint name."""
        return Publisher(
            self.root / layout.validate_name(name),
            keep_last=self.keep_last,
            fsync=self.fsync,
            group=self.group,
            run=self.run,
            fault_hook=self.fault_hook,
            files=self.base_files,
        )

    def begin(
        self,
        name: str,
        *,
        kind: str = layout.KIND_CHECKPOINT,
        step: int | None = None,
        prunable: bool = True,
    ) -> PendingVersion:
        """Prepare (collective): a fresh, empty version directory for ``name``.

        ``kind`` separates checkpoints from exports (``latest_complete`` and retention look
        at one kind); ``prunable=False`` exempts the name from ``keep_last``.
        """
        pending = PendingVersion(
            self, layout.validate_name(name), kind=kind, step=step, prunable=prunable
        )
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
        self.publisher, self.files = publisher, publisher.files
        self.root = publisher.root
        self.name = name
        self.kind, self.step, self.prunable = kind, step, prunable
        self.version_id = ""  # set by _begin(), on every rank
        self._key = disk.root_key(self.root)
        self._written_sha256: dict[str, str] = {}
        self._finished = False

    @property
    def path(self) -> Path:
        return layout.version_dir(self.root, self.version_id)

    # ------------------------------------------------------------------ the sequence
    def _begin(self) -> None:
        """Phase 1 (collective): rank 0 prepares the version, every rank learns its id."""

        def prepare() -> None:
            if self.publisher.is_rank0:
                self._prepare()
            self.files.reached(faults.PHASE_PREPARED)

        self._agreed(f"checkpoint {self.name!r} prepare in {self.root}", prepare)
        self.version_id = broadcast_from_rank0(self.version_id, self.publisher.group)

    def finish(self, error: BaseException | None, *, files_flushed: bool = False) -> Published:
        """Phases 2-6 (collective): write, manifest, flush, point; then retain on rank 0.

        ``error``: this rank's failure to write its files (None if they are all written).
        ``files_flushed``: this rank's writers fsynced every file they wrote (the checkpointer:
        DCP's writer and its own JSON), so phase 2 need not flush them again: every fsync
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
            self.files.reached(faults.PHASE_AFTER_MANIFEST)
            previous = disk.point_name(self.files, self.root, self.name, self.version_id, self._key)
            return Published(self.name, self.path.resolve(), manifest, previous=previous)

        published = self._agreed(f"{what} publish of {self.path}", publish, rank0_only=True)
        published = broadcast_from_rank0(published, pub.group)
        if pub.is_rank0:
            disk.unregister(self._key, self.version_id)
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
        """Write these small files of this rank into the version, note their bytes for the
        manifest and flush them together."""
        for path, data in files.items():
            self.files.write(path, data)
        self.note_written(files)
        self.files.flush(files=list(files))

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
        versions = layout.versions_dir(self.root)
        if not versions.is_dir():
            self.files.make_dir(versions)
            self.files.flush(dirs=[self.root])  # .versions outlives a power loss before any name
        disk.refuse_legacy(layout.link_path(self.root, self.name))
        try:
            disk.collect_garbage(
                self.root, protected=disk.in_flight(self._key), files=self.publisher.base_files
            )  # no fault phases here: retention is reached after publication
        except Exception as exc:  # cleanup never fails a save
            log.warning("Checkpoint cleanup in %s failed (ignored): %s", self.root, exc)
        version_id = layout.new_version_id(self.name)
        disk.register(self._key, version_id)
        try:
            self.files.make_dir(layout.version_dir(self.root, version_id))
        except BaseException:
            disk.unregister(self._key, version_id)
            raise
        self.version_id = version_id

    def _write(self, files_flushed: bool) -> None:
        """Every rank, after its writes: flush every file it can see in the version, unless
        its writers already did (then every file is flushed by the rank that wrote it)."""
        self.files.reached(faults.PHASE_WRITTEN)
        if not files_flushed:
            self.files.flush_tree(self.path)

    def _write_manifest(self) -> tuple[Manifest, list[str]]:
        """Rank 0: the manifest, last, describing every file all ranks wrote (flushed with
        the directories, one merged flush); returns it and the version's directories."""
        self.files.reached(faults.PHASE_BEFORE_MANIFEST)
        files, dirs = layout.scan_tree(self.path)
        manifest = layout.build_manifest(
            self.path,
            name=self.name,
            kind=self.kind,
            step=self.step,
            world_size=world_size(self.publisher.group),
            prunable=self.prunable,
            run=self.publisher.run,
            files=files,
            known_sha256=self._written_sha256,
        )
        self.files.write(layout.manifest_path(self.path), layout.manifest_bytes(manifest))
        return manifest, dirs

    def _flush(self, dirs: list[str]) -> None:
        """Rank 0: the manifest and every directory entry of the version are durable before
        the name moves (one concurrent batch: the flushes merge)."""
        files = [layout.manifest_path(self.path)]
        self.files.flush(files=files, dirs=[*dirs, layout.versions_dir(self.root)])

    def _retain(self, published: Published) -> None:
        """Rank 0, best-effort: prune beyond ``keep_last``, then collect what that pruning
        left unreferenced (this save's prepare already collected all earlier debris). The
        version the name moved away from stays until the next save: readers may still be
        in it."""
        pub = self.publisher
        try:
            pruned = disk.prune_names(
                self.root,
                keep_last=pub.keep_last,
                kind=self.kind,
                keep_name=self.name,
                run=pub.run,
                files=self.files,
            )
            if not pruned:  # prepare collected everything else this save could leave
                return
            protected = disk.in_flight(self._key)
            if published.previous is not None:
                protected.add(published.previous)
            disk.collect_garbage(self.root, protected=protected, files=self.files)
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
        the outcome across ranks: if any rank failed, remove the version and raise the
        agreed ``CheckpointError`` (the same on every rank)."""
        outcome: bool | BaseException = True if error is None else error
        result = None
        if error is None and (self.publisher.is_rank0 or not rank0_only):
            try:
                result = step()
            except Exception as exc:
                outcome = exc
        try:
            agree(outcome, what, self.publisher.group)
        except CheckpointError:
            self._remove()
            raise
        return result

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
            if layout.read_link(self.root, self.name) != self.version_id:
                disk.remove_version(self.path, self.files)
        except (OSError, CheckpointError) as exc:
            log.warning("Could not remove unpublished checkpoint %s: %s", self.path, exc)
        finally:
            disk.unregister(self._key, self.version_id)
