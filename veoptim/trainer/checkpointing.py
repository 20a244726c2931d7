"""How the trainer uses the checkpointer: its root and options, the standard state
components, and the explicit resume step that runs before any callback hook."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import StateComponent
from veoptim.config.schema import CheckpointConfig
from veoptim.distributed import DistContext
from veoptim.errors import ConfigError
from veoptim.lora.state import LoRAModelState, base_fingerprint
from veoptim.state import (
    CONFIG,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    RUN_IDS,
    SAMPLER,
    JSONState,
    ModelState,
    OptimizerState,
    RNGState,
    RunConfigState,
)
from veoptim.state.run_config import WEIGHTS_ONLY_MUST_MATCH
from veoptim.state.stateful import same_structure

if TYPE_CHECKING:
    from veoptim.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def build_checkpointer(cfg: CheckpointConfig, run_dir: Path, ctx: DistContext) -> Checkpointer:
    """The run's checkpointer; async saves get their own process group."""
    async_group = None
    if cfg.async_save and ctx.world_size > 1:
        # async DCP needs its own group: gloo aborts if training reuses the default one.
        async_group = dist.new_group(backend="gloo")
    return Checkpointer(
        cfg.root_dir(run_dir),
        keep_last=cfg.keep_last,
        fsync=cfg.fsync,
        write_threads=cfg.write_threads,
        storage_format=cfg.format,
        async_group=async_group,
    )


def standard_state(trainer: Trainer) -> dict[str, StateComponent]:
    """The components every run checkpoints, in install order (weights before the optimizer)."""
    model = ModelState(trainer.model)
    if trainer.cfg.lora.enabled:  # the adapters, and what base they belong to
        fingerprint = base_fingerprint(
            trainer.model.config, trainer.cfg.model.path, trainer.cfg.model.init_seed
        )
        model = LoRAModelState(trainer.model, fingerprint)
    return {
        MODEL: model,
        OPTIMIZER: OptimizerState(trainer.model, trainer.optimizer, trainer.plan.layout_metadata()),
        # An LR scheduler holds its optimizer: checked by structure, not by a trial load.
        LR_SCHEDULER: JSONState(trainer.scheduler, check=same_structure),
        SAMPLER: JSONState(trainer.sampler),
        PROGRESS: JSONState(trainer.progress),
        RNG: RNGState(trainer.ctx.device, trainer.ctx.world_size),
        CONFIG: RunConfigState(recorded_config(trainer), defaults=default_config(trainer)),
        RUN_IDS: JSONState(trainer.run_ids),
    }


def recorded_config(trainer: Trainer) -> dict[str, Any]:
    """The resolved config a checkpoint records, with ``train.max_steps`` the run's actual
    length (from ``train.epochs``, or the default when neither is set), so a resume compares
    what the schedule targets, not how it was asked for."""
    config = trainer.config_dict
    config["train"] = {**config["train"], "max_steps": trainer.max_steps}
    return config


def default_config(trainer: Trainer) -> dict[str, Any]:
    """The task's default config (keys a checkpoint predates are compared with it)."""
    return asdict(type(trainer.cfg)())


def weights_state(trainer: Trainer) -> dict[str, StateComponent]:
    """The components of a weights-only checkpoint: the model, and the config checked on a
    load by the model keys only."""
    return {
        MODEL: trainer.state[MODEL],
        CONFIG: RunConfigState(recorded_config(trainer), WEIGHTS_ONLY_MUST_MATCH),
    }


def refuse_used_root(checkpointer: Checkpointer) -> None:
    """A fresh run must not re-point the names of another run's checkpoints (agreed)."""
    found = checkpointer.latest()
    if found is not None:
        raise ConfigError(
            f"{checkpointer.root} already holds checkpoints (newest: {found}) and "
            "checkpoint.resume is empty; continue that run with checkpoint.resume=auto, use "
            "another run.dir (or checkpoint.root), or pass checkpoint.overwrite=true to start "
            "over in it."
        )


def preempted_message(trainer: Trainer) -> str:
    """What a preempted run tells the user: where it stopped and how to go on."""
    step = trainer.progress.global_step
    if trainer.cfg.checkpoint.save_on_signal:
        saved = f"its checkpoint is in {trainer.checkpointer.root}"
    else:
        saved = "nothing was saved (checkpoint.save_on_signal=false)"
    return (
        f"stopped on SIGTERM/SIGINT after step {step}; {saved}. Continue with the same "
        "command plus checkpoint.resume=auto."
    )


def load_checkpoint(trainer: Trainer, ref: str, *, load_optimizer: bool = True) -> Path | None:
    """Load ``ref`` into the trainer's state with its checkpointer; the version loaded, or None.

    ``auto`` is resolved once, on rank 0, and agreed; with no checkpoint yet the run
    starts fresh (None). A full load requires the checkpoint's components to be exactly
    the run's; ``load_optimizer=False`` loads the model weights only (checking that the
    model config matches) and leaves everything else as it is.
    """
    path = trainer.checkpointer.resolve(ref)
    if path is None:
        log.info(
            "checkpoint.resume=auto: no checkpoint in %s, starting fresh", trainer.checkpointer.root
        )
        return None
    if load_optimizer:
        step = trainer.checkpointer.load(trainer.state, path)
        what = ", ".join(trainer.state)
    else:
        step = trainer.checkpointer.load(weights_state(trainer), path, exact=False)
        what = "model weights only (optimizer, scheduler and data position start fresh)"
    log.info("restored %s from %s (step %d)", what, path, step)
    return path
