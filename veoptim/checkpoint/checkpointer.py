"""Training checkpoints: save through the publisher, load with validation before mutation.

Every phase ends in a cross-rank agreement (``agree``): write and publish (in
the publisher), then resolve, validate, read and apply on load. A load plans
everything first — the inventory expected from the live model and optimizer is
compared with the checkpoint's metadata, JSON state and layout — reads tensors
into fresh staging buffers, and only then copies into the live objects; a
failed load leaves them bitwise unchanged. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from veoptim.checkpoint import format as F
from veoptim.checkpoint.inventory import (
    compare_inventory,
    model_inventory,
    optimizer_inventory,
    trainable_named_params,
)
from veoptim.checkpoint.manifest import KIND_CHECKPOINT
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.resolve import resolve_agreed
from veoptim.checkpoint.rng import capture_rng, check_rng, restore_rng
from veoptim.checkpoint.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.staging import optimizer_staging, to_json_param_groups
from veoptim.checkpoint.validate import check_config, check_info, read_json
from veoptim.distributed.agreement import agree, rank
from veoptim.distributed.layout import LayoutMetadata
from veoptim.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

FaultHook = Callable[[str], None]
#: What a phase catches and turns into an agreed failure. DCP's CheckpointException
#: derives from BaseException, so ``except Exception`` alone would let it escape.
PHASE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
PHASE_WRITE, PHASE_READ, PHASE_VALIDATE, PHASE_APPLY = "write", "read", "validate", "apply"


@dataclass
class TrainingState:
    """The live objects a checkpoint saves and restores (the trainer hands these over)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    progress: Any
    layout: LayoutMetadata
    config: dict[str, Any]
    device: torch.device
    optimizer_name: str


#: DCP writer threads per rank: each writes its own shard file. Two measured 1.35x the
#: save throughput of one on the development VM (docs/benchmarks.md).
DEFAULT_WRITE_THREADS = 2


class Checkpointer:
    """Saves and loads training checkpoints in one root; at most one async save in flight."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 0,
        fsync: bool = True,
        write_threads: int = DEFAULT_WRITE_THREADS,
        group: Any = None,
        async_group: Any = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        if write_threads < 1:
            raise ConfigError(f"checkpoint.write_threads must be >= 1, got {write_threads}.")
        self.root = Path(root)
        self.write_threads = write_threads
        self.group, self.async_group, self.fault_hook = group, async_group, fault_hook
        self.publisher = Publisher(
            root, keep_last=keep_last, fsync=fsync, group=group, fault_hook=fault_hook
        )
        self.fsync = fsync
        self._in_flight: tuple[PendingVersion, Future] | None = None

    def _hook(self, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase)

    # ------------------------------------------------------------------ save
    def save(
        self, state: TrainingState, name: str, *, async_save: bool = False
    ) -> Published | None:
        """Write and publish ``name``; with ``async_save`` publication happens in :meth:`wait`."""
        self.wait()
        step = state.progress.global_step
        pending = self.publisher.begin(name, kind=KIND_CHECKPOINT, step=step)
        optimizer_state = get_optimizer_state_dict(state.model, state.optimizer)
        tensors = {
            F.MODEL_PREFIX: get_model_state_dict(state.model),
            F.OPTIMIZER_PREFIX: optimizer_state["state"],
        }
        writer = FileSystemWriter(
            pending.path / F.DCP_DIR, sync_files=self.fsync, thread_count=self.write_threads
        )
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
                self._write_side_files(state, optimizer_state["param_groups"], pending.path)
                self._hook(PHASE_WRITE)
            except PHASE_ERRORS as exc:
                error = exc
        if future is not None and error is None:
            self._in_flight = (pending, future)
            return None
        if future is not None:
            _quietly_wait(future)
        return pending.finish(error)

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
        return pending.finish(error)

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

    def _write_side_files(
        self, state: TrainingState, param_groups: list[dict[str, Any]], path: Path
    ) -> None:
        """JSON/YAML next to the DCP shards: rank 0 writes the shared ones, each rank its RNG."""
        rng_dir = path / F.RNG_DIR
        rng_dir.mkdir(exist_ok=True)
        rng_file = rng_dir / F.RNG_FILE_FORMAT.format(rank=rank(self.group))
        rng_file.write_text(json.dumps(capture_rng(state.device)))
        if rank(self.group) != 0:
            return
        trainer_state = {
            F.STATE_PROGRESS: state.progress.state_dict(),
            F.STATE_SAMPLER: state.sampler.state_dict(),
            F.STATE_SCHEDULER: state.scheduler.state_dict(),
            F.STATE_PARAM_GROUPS: to_json_param_groups(param_groups),
        }
        info = {
            F.INFO_FORMAT: F.CHECKPOINT_FORMAT,
            F.INFO_FORMAT_VERSION: F.CHECKPOINT_FORMAT_VERSION,
            F.INFO_STEP: state.progress.global_step,
            F.INFO_WORLD_SIZE: state.layout.world_size,
            F.INFO_OPTIMIZER: state.optimizer_name,
            F.INFO_HAS_OPTIMIZER: True,
        }
        (path / F.TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
        (path / F.LAYOUT_FILE).write_text(json.dumps(state.layout.to_json(), indent=1))
        (path / F.CONFIG_FILE).write_text(yaml.safe_dump(state.config, sort_keys=False))
        (path / F.INFO_FILE).write_text(json.dumps(info, indent=1))

    # ------------------------------------------------------------------ load
    def load(self, state: TrainingState, ref: str, *, load_optimizer: bool = True) -> Path:
        """Restore ``ref`` (``auto``, a name or a path) into ``state``; returns the version dir."""
        self.wait()
        path = resolve_agreed(self.root, ref, self.group)
        plan: _LoadPlan | None = None
        outcome: bool | BaseException = True
        try:
            plan = self._validate(state, path, load_optimizer)
            self._hook(PHASE_VALIDATE)
        except PHASE_ERRORS as exc:
            outcome = exc
        agree(outcome, f"validating checkpoint {path}", self.group)
        assert plan is not None
        outcome = True
        try:
            self._read(plan, path)
            self._hook(PHASE_READ)
        except PHASE_ERRORS as exc:
            outcome = readable(exc)
        agree(outcome, f"reading checkpoint {path}", self.group)
        outcome = True
        try:
            self._hook(PHASE_APPLY)
            self._apply(state, plan)
        except PHASE_ERRORS as exc:
            outcome = exc
        agree(outcome, f"applying checkpoint {path}", self.group)
        what = "model, optimizer, scheduler, data position and RNG" if load_optimizer else "model weights only (optimizer, scheduler and data position start fresh)"  # fmt: skip
        log.info("restored %s from %s (step %d)", what, path, plan.step)
        return path

    def _validate(self, state: TrainingState, path: Path, load_optimizer: bool) -> _LoadPlan:
        info = read_json(path / F.INFO_FILE)
        check_info(info, path, load_optimizer)
        saved_config = yaml.safe_load((path / F.CONFIG_FILE).read_text())
        check_config(saved_config, state.config, path, load_optimizer)
        saved_layout = LayoutMetadata.from_json(read_json(path / F.LAYOUT_FILE))
        metadata = read_dcp_metadata(path / F.DCP_DIR)
        model_live = get_model_state_dict(state.model)
        expected = model_inventory(model_live)
        prefixes: tuple[str, ...] = (F.MODEL_PREFIX,)
        plan = _LoadPlan(step=int(info[F.INFO_STEP]), model={
            k: torch.empty_like(v) for k, v in model_live.items()})  # fmt: skip
        if load_optimizer:
            reason = saved_layout.optimizer_compatible(state.layout)
            if reason is not None:
                raise CheckpointError(
                    f"optimizer state in {path} cannot be loaded into this run: {reason}; resume "
                    "with checkpoint.load_optimizer=false to load the model weights only."
                )
            expected.update(optimizer_inventory(state.model, state.optimizer))
            prefixes += (F.OPTIMIZER_PREFIX,)
            trainer_state = read_json(path / F.TRAINER_STATE_FILE)
            if not isinstance(trainer_state, dict) or set(trainer_state) != set(
                F.TRAINER_STATE_KEYS
            ):
                raise CheckpointError(
                    f"{path / F.TRAINER_STATE_FILE} must have keys {list(F.TRAINER_STATE_KEYS)}."
                )
            rng_file = path / F.RNG_DIR / F.RNG_FILE_FORMAT.format(rank=rank(self.group))
            if saved_layout.world_size == state.layout.world_size:
                plan.rng = read_json(rng_file)
                check_rng(plan.rng, str(rng_file))
            elif rank(self.group) == 0:
                log.warning(
                    "RNG states are not restored: %s was saved on %d ranks, this run has %d "
                    "(weights, optimizer, LR and data order are; random ops such as dropout "
                    "draw other numbers than the uninterrupted run).",
                    path, saved_layout.world_size, state.layout.world_size,
                )  # fmt: skip
            plan.trainer_state = trainer_state
            plan.optimizer = optimizer_staging(state.model, state.optimizer)
            _dry_run_json_state(state, trainer_state, path)
        compare_inventory(expected, metadata, prefixes, path / F.DCP_DIR)
        return plan

    def _read(self, plan: _LoadPlan, path: Path) -> None:
        staged: dict[str, Any] = {F.MODEL_PREFIX: plan.model}
        if plan.optimizer is not None:
            staged[F.OPTIMIZER_PREFIX] = plan.optimizer
        dcp.load(
            staged,
            storage_reader=SafeFileSystemReader(path / F.DCP_DIR),
            planner=DefaultLoadPlanner(allow_partial_load=plan.optimizer is None),
            process_group=self.group,
        )

    def _apply(self, state: TrainingState, plan: _LoadPlan) -> None:
        with torch.no_grad():
            set_model_state_dict(state.model, plan.model)
        if plan.optimizer is None:
            return
        ts = plan.trainer_state
        groups = ts[F.STATE_PARAM_GROUPS]
        for group in groups:
            if "betas" in group:
                group["betas"] = tuple(group["betas"])
        optimizer = state.optimizer
        # A fresh optimizer has no state, so set_optimizer_state_dict would first run DCP's
        # zero-LR "init" step, allocating zero grads and placeholder masters/moments next to
        # the staged ones (resume peak memory above training's). Seeding the state with the
        # staged tensors skips that step; load_state_dict then validates and installs them.
        seeded = not optimizer.state
        if seeded:
            for fqn, param in trainable_named_params(state.model, optimizer):
                optimizer.state[param] = plan.optimizer[fqn]
        try:
            set_optimizer_state_dict(
                state.model, optimizer, {"state": plan.optimizer, "param_groups": groups}
            )
        except BaseException:
            if seeded:
                optimizer.state.clear()
            raise
        state.scheduler.load_state_dict(ts[F.STATE_SCHEDULER])
        state.sampler.load_state_dict(ts[F.STATE_SAMPLER])
        state.progress.load_state_dict(ts[F.STATE_PROGRESS])
        if plan.rng is not None:
            restore_rng(plan.rng, state.device)


@dataclass
class _LoadPlan:
    """Everything a load will install, staged and validated before any live object changes."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]] | None = None
    trainer_state: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None


def _dry_run_json_state(state: TrainingState, trainer_state: dict[str, Any], path: Path) -> None:
    """Load the JSON state into throwaway copies so malformed state fails before mutation."""
    copy.deepcopy(state.sampler).load_state_dict(trainer_state[F.STATE_SAMPLER])
    copy.deepcopy(state.progress).load_state_dict(trainer_state[F.STATE_PROGRESS])
    live = state.scheduler.state_dict()
    saved = trainer_state[F.STATE_SCHEDULER]
    if not isinstance(saved, dict) or set(saved) != set(live):
        raise CheckpointError(
            f"scheduler state in {path / F.TRAINER_STATE_FILE} has keys "
            f"{sorted(saved) if isinstance(saved, dict) else type(saved).__name__}, "
            f"expected {sorted(live)}."
        )
    live_groups = len(state.optimizer.param_groups)
    saved_groups = trainer_state[F.STATE_PARAM_GROUPS]
    if not isinstance(saved_groups, list) or len(saved_groups) != live_groups:
        raise CheckpointError(
            f"optimizer param groups in {path / F.TRAINER_STATE_FILE}: expected {live_groups} "
            f"groups, found {len(saved_groups) if isinstance(saved_groups, list) else saved_groups!r}."
        )


def readable(error: BaseException) -> BaseException:
    """DCP's CheckpointException as a CheckpointError naming each failing rank's own cause.

    Its text is whole tracebacks, so the agreed message (causes are cut at a few hundred
    characters) would otherwise lose the actual cause, e.g. ``ENOSPC`` on rank 1.
    """
    if not isinstance(error, CheckpointException):
        return error
    causes = "; ".join(
        f"rank {rank}: {type(cause).__name__}: {cause}"
        for rank, (cause, _trace) in sorted(error.failures.items())
    )
    readable_error = CheckpointError(f"DCP failed on {causes or 'an unknown rank'}")
    readable_error.__cause__ = error  # keep DCP's tracebacks for the logs
    return readable_error


def _quietly_wait(future: Future) -> None:
    try:
        future.result()
    except PHASE_ERRORS as exc:  # the write already failed; this is only cleanup
        log.debug("async checkpoint write also failed: %s", exc)
