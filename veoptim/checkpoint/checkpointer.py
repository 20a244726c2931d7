"""Training checkpoints of named state components: save through the publisher, load with
validation before mutation.

A save gathers every component's state, writes the tensors in one DCP save (keys
``<component>.<key>``) and each component's JSON beside them, records the component
list in ``checkpoint.json`` and publishes the version. A load runs three phases, each
ending in a cross-rank agreement (``agree``): *validate* (the checkpoint's format and
component list, then every component stages itself: checks its saved JSON, declares
the tensors it expects, allocates fresh buffers; the expected inventory is compared
with the DCP metadata), *read* (DCP reads into the buffers) and *apply* (every
component installs its staged state). Nothing live changes before apply, so a
rejected checkpoint leaves the run bitwise unchanged. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from veoptim.checkpoint import contents as C
from veoptim.checkpoint.component import (
    ComponentState,
    SavedComponent,
    Staged,
    StateComponent,
    check_component_name,
)
from veoptim.checkpoint.durable import fsync_all
from veoptim.checkpoint.faults import (
    PHASE_APPLY,
    PHASE_GATHER,
    PHASE_READ,
    PHASE_VALIDATE,
    PHASE_WRITE,
    PHASE_WRITER,
    FaultHook,
    fire,
)
from veoptim.checkpoint.inventory import compare_inventory, prefixed, saved_inventory
from veoptim.checkpoint.manifest import KIND_CHECKPOINT
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.raw_writer import RawFileSystemWriter
from veoptim.checkpoint.readahead import ShardPrefetch
from veoptim.checkpoint.resolve import latest_complete, resolve_agreed
from veoptim.checkpoint.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.validate import check_components, check_info, read_json
from veoptim.distributed.agreement import agree, on_rank0, rank, world_size
from veoptim.errors import CheckpointError, ConfigError, LiveStateInvalidError

log = logging.getLogger(__name__)

Components = Mapping[str, StateComponent]
#: What a phase catches and turns into an agreed failure. DCP's CheckpointException
#: derives from BaseException, so ``except Exception`` alone would let it escape.
PHASE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
#: DCP names its writer threads after their target function (``Thread-1 (<target>)``).
_DCP_WRITER_TARGET = "_write_files_from_queue"
#: DCP writer threads per rank: each writes its own shard file. Two measured 1.35x the
#: save throughput of one on the development VM (docs/benchmarks.md).
DEFAULT_WRITE_THREADS = 2
#: Byte layouts of the DCP shards (checkpoint.format): ``raw`` (veoptim's, fast; read by
#: veoptim, converted by ``veoptim-export --format dcp``) or ``dcp`` (DCP's own
#: ``torch_save`` records, readable by torch's tools). Both are read whatever is configured.
FORMAT_RAW, FORMAT_DCP = "raw", "dcp"
FORMATS = (FORMAT_RAW, FORMAT_DCP)
DEFAULT_FORMAT = FORMAT_RAW


class Checkpointer:
    """Saves and loads checkpoints of named components in one root; at most one async save
    in flight."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 0,
        fsync: bool = True,
        write_threads: int = DEFAULT_WRITE_THREADS,
        storage_format: str = DEFAULT_FORMAT,
        group: Any = None,
        async_group: Any = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if write_threads < 1:
            raise ConfigError(f"checkpoint.write_threads must be >= 1, got {write_threads}.")
        if storage_format not in FORMATS:
            raise ConfigError(
                f"checkpoint.format must be one of {list(FORMATS)}, got {storage_format!r}."
            )
        self.root = Path(root)
        self.storage_format = storage_format
        self.write_threads, self.fsync = write_threads, fsync
        self.group, self.async_group, self.fault_hook = group, async_group, fault_hook
        self.publisher = Publisher(
            root, keep_last=keep_last, fsync=fsync, group=group, fault_hook=fault_hook
        )
        self._in_flight: tuple[PendingVersion, Future] | None = None
        quiet_writer_threads()

    # ------------------------------------------------------------------ save
    def save(
        self,
        components: Components,
        name: str,
        *,
        step: int,
        layout: Mapping[str, Any] | None = None,
        weights_only: bool = False,
        async_save: bool = False,
    ) -> Published | None:
        """Write and publish ``name``; with ``async_save`` publication happens in :meth:`wait`.

        ``layout`` (JSON) describes the parallel layout the state was saved under;
        ``weights_only`` records that ``components`` are a weights-only subset of the run's
        state (a "sampler" checkpoint), which a full resume refuses before reading anything.
        Every stage ends in agreement: gathering, creating the writer, the JSON files, the
        DCP write (DCP agrees itself), then the publisher's manifest, flush and point. With
        ``fsync`` every file is flushed by the rank that writes it (the JSON files together,
        before the tensors; DCP's shards by its writer), so the publisher does not fsync
        them a second time.
        """
        self.wait()
        for component_name in components:
            check_component_name(component_name)
        pending = self.publisher.begin(name, kind=KIND_CHECKPOINT, step=step)

        def gather() -> dict[str, ComponentState]:
            fire(self.fault_hook, PHASE_GATHER)
            return {key: component.state() for key, component in components.items()}

        def make_writer() -> FileSystemWriter:
            fire(self.fault_hook, PHASE_WRITER)
            kind = RawFileSystemWriter if self.storage_format == FORMAT_RAW else FileSystemWriter
            return kind(
                pending.path / C.DCP_DIR, sync_files=self.fsync, thread_count=self.write_threads
            )

        def write_json() -> None:
            written = self._write_json(states, pending.path, step, dict(layout or {}), weights_only)
            pending.note_written(written)
            if self.fsync:
                fsync_all(list(written))

        states = pending.run("gathering state", gather)
        writer = pending.run("creating the writer", make_writer)
        pending.run("writing the JSON state", write_json)
        tensors = {key: state.tensors for key, state in states.items() if state.tensors}
        future: Future | None = None
        error: BaseException | None = None
        try:
            if async_save:
                future = dcp.async_save(
                    tensors, storage_writer=writer, process_group=self.async_group
                )
            else:
                dcp.save(tensors, storage_writer=writer, process_group=self.group)
        except PHASE_ERRORS as exc:  # DCP raises on every rank when any rank's write fails
            error = readable(exc)
        if error is None:
            try:
                fire(self.fault_hook, PHASE_WRITE)
            except PHASE_ERRORS as exc:
                error = exc
        if future is not None and error is None:
            self._in_flight = (pending, future)
            return None
        if future is not None:
            _quietly_wait(future)
        return pending.finish(error, files_flushed=True)

    def wait(self) -> Published | None:
        """Finish the in-flight async save (publish it, or raise its agreed failure)."""
        if self._in_flight is None:
            return None
        pending, future = self._in_flight
        self._in_flight = None
        error: BaseException | None = None
        try:
            future.result()
        except PHASE_ERRORS as exc:
            error = readable(exc)
        return pending.finish(error, files_flushed=True)

    def abandon(self) -> str | None:
        """Drop the in-flight async save without publishing it (training failed; peers may be
        gone, so no collective is attempted). Its directory is removed."""
        if self._in_flight is None:
            return None
        pending, future = self._in_flight
        self._in_flight = None
        _quietly_wait(future)
        pending.discard()
        return pending.name

    def _write_json(
        self,
        states: dict[str, ComponentState],
        path: Path,
        step: int,
        layout: dict[str, Any],
        weights_only: bool,
    ) -> dict[Path, bytes]:
        """Each component's JSON (rank 0 the shared ones, every rank its own), then, on rank 0,
        ``checkpoint.json`` describing them; returns the files written and their bytes."""
        me = rank(self.group)
        written: dict[Path, bytes] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, state in states.items():
            scope = None
            if state.json is not None:
                scope = C.JSON_PER_RANK if state.json_per_rank else C.JSON_SHARED
                target = (
                    C.rank_json_path(path, name, me)
                    if state.json_per_rank
                    else C.shared_json_path(path, name)
                )
                if state.json_per_rank or me == 0:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    written[target] = json.dumps(state.json, indent=1).encode()
                    target.write_bytes(written[target])
            entries[name] = {C.COMPONENT_TENSORS: bool(state.tensors), C.COMPONENT_JSON: scope}
        if me != 0:
            return written
        info = {
            C.INFO_FORMAT: C.CHECKPOINT_FORMAT,
            C.INFO_FORMAT_VERSION: C.CHECKPOINT_FORMAT_VERSION,
            C.INFO_STEP: step,
            C.INFO_WORLD_SIZE: world_size(self.group),
            C.INFO_LAYOUT: layout,
            C.INFO_WEIGHTS_ONLY: weights_only,
            C.INFO_COMPONENTS: entries,
        }
        written[path / C.INFO_FILE] = json.dumps(info, indent=1).encode()
        (path / C.INFO_FILE).write_bytes(written[path / C.INFO_FILE])
        return written

    # ------------------------------------------------------------------ load
    def latest(self) -> str | None:
        """The newest complete checkpoint's name in the root (rank 0 looks; agreed)."""
        return on_rank0(
            lambda: latest_complete(self.root),
            f"listing the checkpoints in {self.root}",
            self.group,
        )

    def resolve(self, ref: str) -> Path | None:
        """The version directory of ``ref`` (``auto`` = newest complete checkpoint, a name or
        a path), resolved once on rank 0 and agreed; None for ``auto`` in an empty root."""
        return resolve_agreed(self.root, ref, self.group)

    def restore(
        self, components: Components, ref: str, *, exact: bool = True
    ) -> tuple[Path, int] | None:
        """Resolve ``ref`` once (agreed; ``auto`` = the newest complete checkpoint) and load
        it into ``components``: the version and its step, or None for ``auto`` in a root
        without a complete checkpoint. ``exact`` as for :meth:`load`."""
        path = self.resolve(ref)
        if path is None:
            return None
        return path, self.load(components, path, exact=exact)

    def load(self, components: Components, path: Path, *, exact: bool = True) -> int:
        """Restore ``components`` from the resolved version ``path``; returns its step.

        ``exact``: the checkpoint must hold exactly these components (a full resume);
        otherwise it may hold more, which are left unread (e.g. weights only).
        """
        self.wait()
        prefetch = ShardPrefetch(path / C.DCP_DIR, rank(self.group))  # reads while we validate
        try:
            return self._load(components, path, exact)
        finally:
            prefetch.stop()

    def _load(self, components: Components, path: Path, exact: bool) -> int:
        staged: dict[str, Staged] = {}
        step, metadata = 0, None
        outcome: bool | BaseException = True
        try:
            staged, step, metadata = self._stage(components, path, exact)
            fire(self.fault_hook, PHASE_VALIDATE)
        except PHASE_ERRORS as exc:
            outcome = exc
        agree(outcome, f"validating checkpoint {path}", self.group)
        outcome = True
        try:
            self._read(staged, path, metadata)
            fire(self.fault_hook, PHASE_READ)
        except PHASE_ERRORS as exc:
            outcome = readable(exc)
        agree(outcome, f"reading checkpoint {path}", self.group)
        outcome = True
        try:
            fire(self.fault_hook, PHASE_APPLY)
            for name, loaded in staged.items():
                loaded.install()
                fire(self.fault_hook, f"{PHASE_APPLY}:{name}")
        except PHASE_ERRORS as exc:
            outcome = exc
        try:
            agree(outcome, f"applying checkpoint {path}", self.group)
        except CheckpointError as exc:
            raise LiveStateInvalidError(
                f"{exc} The live state may now be partly loaded and is not valid: this run "
                "must stop; start a new process and resume from a checkpoint."
            ) from exc
        return step

    def _stage(
        self, components: Components, path: Path, exact: bool
    ) -> tuple[dict[str, Staged], int, Metadata]:
        """Validate the whole checkpoint against the live components; allocate read buffers.
        Returns the staged components, the step and the (validated) DCP metadata."""
        info = check_info(read_json(path / C.INFO_FILE), path)
        saved = info[C.INFO_COMPONENTS]
        if exact and info.get(C.INFO_WEIGHTS_ONLY):
            raise CheckpointError(
                f"{path} is a weights-only checkpoint (it holds {', '.join(saved)}; written "
                "with checkpoint.save_optimizer=false), so it cannot restore the whole run; "
                "resume from it with checkpoint.load_optimizer=false."
            )
        check_components(saved, components, path, exact=exact)
        dcp_dir = path / C.DCP_DIR
        metadata = read_dcp_metadata(dcp_dir)
        staged: dict[str, Staged] = {}
        expected, found = {}, {}
        for name, component in components.items():
            view = SavedComponent(
                name=name,
                path=path,
                json=self._saved_json(path, name, saved[name], info),
                tensors=saved_inventory(metadata, name, dcp_dir),
                step=info[C.INFO_STEP],
                world_size=info[C.INFO_WORLD_SIZE],
                layout=info.get(C.INFO_LAYOUT),
            )
            staged[name] = component.stage(view)
            expected.update(prefixed(name, staged[name].expected))
            found.update(prefixed(name, view.tensors))
        compare_inventory(expected, found, dcp_dir)
        return staged, info[C.INFO_STEP], metadata

    def _saved_json(self, path: Path, name: str, entry: dict[str, Any], info: dict) -> Any:
        scope = entry.get(C.COMPONENT_JSON)
        if scope == C.JSON_SHARED:
            return read_json(C.shared_json_path(path, name))
        if scope == C.JSON_PER_RANK:
            me = rank(self.group)
            return (
                read_json(C.rank_json_path(path, name, me))
                if me < info[C.INFO_WORLD_SIZE]
                else None
            )
        if scope is not None:
            raise CheckpointError(
                f"{path / C.INFO_FILE}: component {name!r} has JSON scope {scope!r}."
            )
        return None

    def _read(self, staged: dict[str, Staged], path: Path, metadata: Metadata | None) -> None:
        buffers = {name: s.buffers for name, s in staged.items() if s.buffers}
        if not buffers:
            return
        dcp.load(
            buffers,
            storage_reader=SafeFileSystemReader(path / C.DCP_DIR, metadata),
            # Validation matched every loaded component's inventory exactly; other saved
            # components (e.g. the optimizer on a weights-only load) are left unread.
            planner=DefaultLoadPlanner(allow_partial_load=True),
            process_group=self.group,
        )


def readable(error: BaseException) -> BaseException:
    """DCP's CheckpointException as a CheckpointError naming each failing rank's own cause.

    Its text is whole tracebacks, so the agreed message (causes are cut at a few hundred
    characters) would otherwise lose the actual cause, e.g. ``ENOSPC`` on rank 1.
    """
    if not isinstance(error, CheckpointException):
        return error
    causes = "; ".join(
        f"rank {rank}: {_root_cause(cause)}"
        for rank, (cause, _trace) in sorted(error.failures.items())
    )
    readable_error = CheckpointError(f"DCP failed on {causes or 'an unknown rank'}")
    readable_error.__cause__ = error  # keep DCP's tracebacks for the logs
    return readable_error


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


def _quietly_wait(future: Future) -> None:
    try:
        future.result()
    except PHASE_ERRORS as exc:  # the write already failed; this is only cleanup
        log.debug("async checkpoint write also failed: %s", exc)
