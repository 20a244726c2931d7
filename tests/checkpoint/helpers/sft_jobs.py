"""Spawn workers that run several ``tasks.sft`` jobs and checkpoint loads in one process group.

An ``sft`` job is exactly what ``python -m tasks.sft <overrides>`` runs (``run_task`` on
a composed config); the ranks already joined the default group, so
``init_distributed`` reuses it and the jobs run back to back (one torch import per
rank). A ``load`` job builds the trainer of a config, loads a checkpoint into it with
the real ``Checkpointer`` and, if that succeeds, saves the loaded state as a new
checkpoint (the test reads both back and compares them); if it fails, it records the
error and whether the live state stayed bitwise unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMON = [
    "run.device=cpu",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "scheduler.warmup_steps=1",
    "optim.lr=3e-3",
    "optim.weight_decay=0.1",
    "logging.progress=false",
    "logging.level=WARNING",
    "export.hf=false",
    "checkpoint.fsync=false",
]
RELOADED = "reloaded"


@dataclass(frozen=True)
class SftJob:
    """One ``python -m tasks.sft`` run."""

    overrides: tuple[str, ...]


@dataclass(frozen=True)
class LoadJob:
    """Load ``ref`` into the trainer built from ``overrides``; re-save it under ``out_root``."""

    key: str
    overrides: tuple[str, ...]
    ref: str
    load_optimizer: bool
    out_root: str


def job_env(ctx: Any) -> dict[str, str]:
    """The launcher variables ``init_distributed`` reads (the group already exists)."""
    if ctx.world_size == 1:
        return {}
    rank = str(ctx.rank)
    return {"WORLD_SIZE": str(ctx.world_size), "RANK": rank, "LOCAL_RANK": rank}


def full_state(trainer: Any) -> dict[str, Any]:
    """Full (unsharded) copies of every parameter and optimizer state tensor (collective)."""
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor().clone()
        return t.detach().clone() if hasattr(t, "detach") else t

    out: dict[str, Any] = {}
    for name, param in trainer.model.named_parameters():
        out[name] = full(param)
        for key, value in trainer.optimizer.state.get(param, {}).items():
            out[f"{name}/{key}"] = full(value)
    return out


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _load(ctx: Any, job: LoadJob) -> dict[str, Any]:
    from tasks.compose import compose_config
    from veoptim.checkpoint.checkpointer import Checkpointer
    from veoptim.config import to_config
    from veoptim.errors import CheckpointError
    from veoptim.trainer import Trainer

    sft = to_config(compose_config("sft", [*COMMON, *job.overrides]))
    trainer = Trainer.from_config(sft, ctx, [])
    trainer.checkpointer = Checkpointer(job.out_root, fsync=False)
    before = full_state(trainer)
    progress_before = trainer.progress.state_dict()
    try:
        with counting_dcp_installs() as dcp_installs:
            trainer.load_checkpoint(job.ref, load_optimizer=job.load_optimizer)
    except CheckpointError as error:
        unchanged = same_state(before, full_state(trainer))
        unchanged = unchanged and progress_before == trainer.progress.state_dict()
        return {"error": str(error), "unchanged": unchanged}
    trainer.save_checkpoint(RELOADED)
    return {"error": None, "step": trainer.progress.global_step, "dcp_installs": dcp_installs}


@contextmanager
def counting_dcp_installs() -> Iterator[list[str]]:
    """Records each install that went through DCP's ``set_*_state_dict`` (the real ones
    run): a load whose model and optimizer are installed directly records none."""
    import veoptim.lora.state as lora_state
    import veoptim.state.model as model_state
    import veoptim.state.optimizer as optimizer_state

    calls: list[str] = []
    patched = [(model_state, "set_model_state_dict"), (lora_state, "set_model_state_dict"),
               (optimizer_state, "set_optimizer_state_dict")]  # fmt: skip
    originals = [getattr(module, name) for module, name in patched]

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for (module, name), real in zip(patched, originals, strict=True):
        setattr(module, name, spy(name, real))
    try:
        yield calls
    finally:
        for (module, name), real in zip(patched, originals, strict=True):
            setattr(module, name, real)


def run_jobs(ctx: Any, out: Path, jobs: list[SftJob | LoadJob]) -> dict[str, Any]:
    """Run every job in order; returns load results by key and each job's wall time."""
    from tasks.compose import compose_config
    from tasks.runner import run_task

    seconds: list[float] = []
    loads: dict[str, Any] = {}
    for job in jobs:
        start = time.monotonic()
        if isinstance(job, SftJob):
            run_task(compose_config("sft", [*COMMON, *job.overrides]), env=job_env(ctx))
        else:
            loads[job.key] = _load(ctx, job)
        seconds.append(round(time.monotonic() - start, 2))
    return {"seconds": seconds, "loads": loads}
