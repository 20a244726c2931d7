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
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from veoptim.checkpoint import storage
from veoptim.checkpoint.component import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_VERSION,
    COMPONENT_JSON,
    COMPONENT_TENSORS,
    DCP_DIR,
    INFO_COMPONENTS,
    INFO_FILE,
    INFO_FORMAT,
    INFO_FORMAT_VERSION,
    INFO_LAYOUT,
    INFO_STEP,
    INFO_WEIGHTS_ONLY,
    INFO_WORLD_SIZE,
    JSON_PER_RANK,
    JSON_SHARED,
    ComponentState,
    Inventory,
    SavedComponent,
    SavedEntry,
    Staged,
    StateComponent,
    check_component_name,
    check_components,
    check_info,
    compare_inventory,
    prefixed,
    rank_json_path,
    read_info,
    read_json,
    saved_inventory,
    shared_json_path,
)
from veoptim.checkpoint.faults import (
    PHASE_APPLY,
    PHASE_GATHER,
    PHASE_READ,
    PHASE_VALIDATE,
    PHASE_WRITE,
    PHASE_WRITER,
    FaultHook,
)
from veoptim.checkpoint.layout import KIND_CHECKPOINT
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.reader import CheckpointRead, read_checkpoint
from veoptim.checkpoint.versions import Resolved, latest_complete, locate
from veoptim.distributed.agreement import agreed, on_rank0, rank, world_size
from veoptim.errors import CheckpointError, ConfigError, LiveStateInvalidError

log = logging.getLogger(__name__)

Components = Mapping[str, StateComponent]
#: DCP writer threads per rank: each writes its own shard file. Two measured 1.35x the
#: save throughput of one on the development VM (docs/benchmarks.md).
DEFAULT_WRITE_THREADS = 2
DEFAULT_FORMAT = storage.FORMAT_RAW


@dataclass(frozen=True)
class CheckpointDescription(Resolved):
    """What :meth:`Checkpointer.resolve` found: the complete version (``Resolved``: the
    name, path, run and step, from the one verified read of its manifest) and what its
    ``checkpoint.json`` records: whether it is weights-only and each component with the
    kinds of state it saved."""

    weights_only: bool = False
    components: tuple[SavedEntry, ...] = ()


def describe(resolved: Resolved) -> CheckpointDescription:
    """``resolved`` with what its ``checkpoint.json`` records (checked: a version that is
    not a training checkpoint, e.g. an export, is a ``CheckpointError``)."""
    info = read_info(resolved.path)
    return CheckpointDescription(
        resolved.name,
        resolved.path,
        resolved.run,
        resolved.step,
        weights_only=info.weights_only,
        components=info.entries,
    )


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
        if storage_format not in storage.FORMATS:
            raise ConfigError(
                f"checkpoint.format must be one of {list(storage.FORMATS)}, got {storage_format!r}."
            )
        self.root = Path(root)
        self.storage_format = storage_format
        self.write_threads, self.fsync = write_threads, fsync
        self.group, self.async_group = group, async_group
        self.publisher = Publisher(
            root, keep_last=keep_last, fsync=fsync, group=group, fault_hook=fault_hook
        )
        self._fault_hook = fault_hook
        self._in_flight: tuple[PendingVersion, Future] | None = None

    @property
    def run(self) -> str | None:
        """The run id every checkpoint it saves records (None until the run has one)."""
        return self.publisher.run

    @run.setter
    def run(self, run_id: str | None) -> None:
        self.publisher.run = run_id

    @property
    def fault_hook(self) -> FaultHook | None:
        """Called at every save and load phase (tests inject faults with it)."""
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self._fault_hook = self.publisher.fault_hook = hook

    def _reached(self, phase: str) -> None:
        """The checkpointer's own phases (``faults.SAVE_PHASES``, ``LOAD_PHASES``)."""
        if self._fault_hook is not None:
            self._fault_hook(phase)

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
        within: str | None = None,
    ) -> Published | None:
        """Write and publish ``name``; with ``async_save`` publication happens in :meth:`wait`.

        ``within``: publish under the root ``<root>/<within>`` instead (its own names and
        retention; e.g. one directory per slot checkpoint name).

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
        publisher = self.publisher if within is None else self.publisher.under(within)
        pending = publisher.begin(name, kind=KIND_CHECKPOINT, step=step)
        with pending.agreed("gathering state"):
            self._reached(PHASE_GATHER)
            states = {key: component.state() for key, component in components.items()}
        with pending.agreed("creating the writer"):
            self._reached(PHASE_WRITER)
            writer = storage.tensor_writer(
                pending.path / DCP_DIR,
                storage_format=self.storage_format,
                fsync=self.fsync,
                threads=self.write_threads,
            )
        with pending.agreed("writing the JSON state"):
            files = self._json_files(states, pending.path, step, dict(layout or {}), weights_only)
            pending.write_files(files)
        tensors = {key: state.tensors for key, state in states.items() if state.tensors}
        future: Future | None = None
        error: BaseException | None = None
        try:  # DCP raises on every rank when any rank's write fails
            future = storage.save_tensors(
                tensors,
                writer,
                group=self.group,
                async_group=self.async_group,
                asynchronous=async_save,
            )
            self._reached(PHASE_WRITE)
        except Exception as exc:
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
        except Exception as exc:
            error = exc
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

    def _json_files(
        self,
        states: dict[str, ComponentState],
        path: Path,
        step: int,
        layout: dict[str, Any],
        weights_only: bool,
    ) -> dict[Path, bytes]:
        """The JSON files this rank writes: each component's (rank 0 the shared ones, every
        rank its own), then, on rank 0, ``checkpoint.json`` describing them."""
        me = rank(self.group)
        files: dict[Path, bytes] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, state in states.items():
            scope = None
            if state.json is not None:
                scope = JSON_PER_RANK if state.json_per_rank else JSON_SHARED
                if state.json_per_rank or me == 0:
                    target = (
                        rank_json_path(path, name, me)
                        if state.json_per_rank
                        else shared_json_path(path, name)
                    )
                    files[target] = json.dumps(state.json, indent=1).encode()
            entries[name] = {COMPONENT_TENSORS: bool(state.tensors), COMPONENT_JSON: scope}
        if me != 0:
            return files
        info = {
            INFO_FORMAT: CHECKPOINT_FORMAT,
            INFO_FORMAT_VERSION: CHECKPOINT_FORMAT_VERSION,
            INFO_STEP: step,
            INFO_WORLD_SIZE: world_size(self.group),
            INFO_LAYOUT: layout,
            INFO_WEIGHTS_ONLY: weights_only,
            INFO_COMPONENTS: entries,
        }
        files[path / INFO_FILE] = json.dumps(info, indent=1).encode()
        return files

    # ------------------------------------------------------------------ load
    def latest(self, run: str | None = None) -> str | None:
        """The newest complete checkpoint's name in the root, of ``run`` (None: of any run);
        rank 0 looks, agreed."""
        return on_rank0(
            lambda: latest_complete(self.root, run=run),
            f"listing the checkpoints in {self.root}",
            self.group,
        )

    def resolve(self, ref: str, *, run: str | None = None) -> CheckpointDescription | None:
        """The version of ``ref`` (``auto`` = the newest complete checkpoint ``run``
        published, any run's when None; or a name or a path, whoever wrote it), resolved
        once on rank 0 (its manifest read and verified once) and agreed, described; None
        for ``auto`` when there is none."""

        def find() -> CheckpointDescription | None:
            resolved = locate(self.root, ref, run=run)
            return None if resolved is None else describe(resolved)

        return on_rank0(find, f"resolving checkpoint {ref!r}", self.group)

    def read(
        self,
        checkpoint: Resolved | Path,
        tensors: Mapping[str, Inventory | None] | None = None,
        *,
        json: Collection[str] = (),
        needs: Collection[str] = (),
    ) -> CheckpointRead:
        """Validate a resolved version (:meth:`resolve`'s, or its directory) and read the
        tensors of the components in ``tensors`` (each its expected inventory, or None for
        whatever it saved) and the JSON of those in ``json`` (``needs``: components that
        must be saved, though nothing of them is read), without applying them to
        anything (``reader.py``; this process alone). Nothing is read if anything does not
        match: one ``CheckpointError``."""
        path = checkpoint.path if isinstance(checkpoint, Resolved) else Path(checkpoint)
        return read_checkpoint(path, tensors, json=json, needs=needs, rank=rank(self.group))

    def restore(
        self, components: Components, ref: str, *, exact: bool = True, run: str | None = None
    ) -> tuple[CheckpointDescription, int] | None:
        """Resolve ``ref`` once (agreed; ``run`` as for :meth:`resolve`) and load it into
        ``components``: the version and its step, or None for ``auto`` when there is no
        complete checkpoint of ``run``. ``exact`` as for :meth:`load`."""
        resolved = self.resolve(ref, run=run)
        if resolved is None:
            return None
        return resolved, self.load(components, resolved.path, exact=exact)

    def load(self, components: Components, path: Path, *, exact: bool = True) -> int:
        """Restore ``components`` from the resolved version ``path``; returns its step.

        ``exact``: the checkpoint must hold exactly these components (a full resume);
        otherwise it may hold more, which are left unread (e.g. weights only).
        """
        self.wait()
        with storage.reading_ahead(path / DCP_DIR, rank(self.group)):  # while we validate
            return self._load(components, path, exact)

    def validate(self, components: Components, path: Path, *, exact: bool = True) -> None:
        """Every check :meth:`load` makes of ``path`` before it reads a tensor (agreed, on
        every rank), and nothing else: whether that load would be refused (CheckpointError),
        so a hint to load it can be checked before it is given. No live state changes."""
        with agreed(f"validating checkpoint {path}", self.group):
            self._stage(components, path, exact)

    def _load(self, components: Components, path: Path, exact: bool) -> int:
        with agreed(f"validating checkpoint {path}", self.group):
            staged, step, metadata = self._stage(components, path, exact)
            self._reached(PHASE_VALIDATE)
        with agreed(f"reading checkpoint {path}", self.group):
            self._read(staged, path, metadata)
            self._reached(PHASE_READ)
        try:
            with agreed(f"applying checkpoint {path}", self.group):
                self._reached(PHASE_APPLY)
                for name, loaded in staged.items():
                    loaded.install()
                    self._reached(f"{PHASE_APPLY}:{name}")
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
        info = check_info(read_json(path / INFO_FILE), path)
        saved = info[INFO_COMPONENTS]
        if exact and info.get(INFO_WEIGHTS_ONLY):
            raise CheckpointError(
                f"{path} is a weights-only checkpoint (it holds {', '.join(saved)}; written "
                "with checkpoint.save_optimizer=false), so it cannot restore the whole run; "
                "resume from it with checkpoint.load_optimizer=false."
            )
        check_components(saved, components, path, exact=exact)
        dcp_dir = path / DCP_DIR
        metadata = storage.read_metadata(dcp_dir)
        staged: dict[str, Staged] = {}
        expected, found = {}, {}
        for name, component in components.items():
            view = SavedComponent(
                name=name,
                path=path,
                json=self._saved_json(path, name, saved[name], info),
                tensors=saved_inventory(metadata, name, dcp_dir),
                step=info[INFO_STEP],
                world_size=info[INFO_WORLD_SIZE],
                layout=info.get(INFO_LAYOUT),
            )
            staged[name] = component.stage(view)
            expected.update(prefixed(name, staged[name].expected))
            found.update(prefixed(name, view.tensors))
        compare_inventory(expected, found, dcp_dir)
        return staged, info[INFO_STEP], metadata

    def _saved_json(self, path: Path, name: str, entry: dict[str, Any], info: dict) -> Any:
        scope = entry.get(COMPONENT_JSON)
        if scope == JSON_SHARED:
            return read_json(shared_json_path(path, name))
        if scope == JSON_PER_RANK:
            me = rank(self.group)
            return read_json(rank_json_path(path, name, me)) if me < info[INFO_WORLD_SIZE] else None
        if scope is not None:
            raise CheckpointError(
                f"{path / INFO_FILE}: component {name!r} has JSON scope {scope!r}."
            )
        return None

    def _read(self, staged: dict[str, Staged], path: Path, metadata: Metadata | None) -> None:
        buffers = {name: s.buffers for name, s in staged.items() if s.buffers}
        if not buffers:
            return
        storage.load_tensors(buffers, path / DCP_DIR, metadata, group=self.group)


def _quietly_wait(future: Future) -> None:
    try:
        future.result()
    except Exception as exc:  # the write already failed; this is only cleanup
        log.debug("async checkpoint write also failed: %s", exc)
