"""What every training task does once its config is composed: set up, train, tear down.

A task is a few lines (see ``tasks/sft.py``): its schema (a ``TrainerConfig``
subclass that builds its objective) registered under its name, and ``task_main``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from veoptim.config import TrainerConfig, prefer_explicit, to_config
from veoptim.errors import VeoptimError
from veoptim.trainer import Callback, Metrics

from .cli import task_command

if TYPE_CHECKING:
    from veoptim.distributed import DistContext
    from veoptim.trainer import Trainer

# The checkout's top-level tasks/ and callbacks/ ship as veoptim.tasks and veoptim.callbacks
# (setup.py): no generic top-level name in a user's site-packages.
if __package__ == "veoptim.tasks":
    from veoptim.callbacks import standard_callbacks
else:
    from callbacks import standard_callbacks

# Torch, the trainer and the callback modules are imported once the config is valid (in
# run_task), so that a mistyped command line or --help is answered without loading them.

log = logging.getLogger("veoptim")


def run_dir_of_job(cfg: DictConfig) -> str:
    """Hydra's output dir of this job: ``run.dir`` for a single run, ``run.dir/<n>`` in a sweep."""
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.output_dir
    return cfg.run.dir


def job_overrides() -> list[str]:
    """This job's command-line overrides (Hydra's; none outside a task command)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run_task(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> dict[str, float]:
    """Train from a composed task config; returns the first and last logged loss."""
    cfg = cfg.copy()
    cfg.run.dir = run_dir_of_job(cfg)
    prefer_explicit(cfg, job_overrides())  # e.g. a warmup_ratio replaces the preset's steps
    config = to_config(cfg)
    if config.run.dry_run:  # every check of the startup, then the plan; no process group
        return dry_run(config, env)
    from veoptim.distributed import init_distributed

    resolved = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    # The trainer lives only in _train's frame, so closing the context can free the process
    # groups it holds (see DistContext.close).
    with init_distributed(config.run.device, config.parallel.backend, env) as ctx:
        return _train(config, ctx, resolved)


def dry_run(config: TrainerConfig, env: Mapping[str, str] = os.environ) -> dict[str, float]:
    """``run.dry_run=true``: check the run on every rank (``plan_run``), rank 0 prints the plan."""
    from veoptim.trainer.dry_run import plan_run

    plan = plan_run(config, world_size=int(env.get("WORLD_SIZE", "1")))
    if int(env.get("RANK", "0")) == 0:
        print("dry run: the config is valid and the data and model load; nothing was trained "
              "or saved. The run would be:", *plan.lines(), sep="\n")  # fmt: skip
    return {"first_loss": float("nan"), "final_loss": float("nan")}


def _train(config: TrainerConfig, ctx: DistContext, resolved: Any) -> dict[str, float]:
    from veoptim.distributed import setup_logging
    from veoptim.trainer import Trainer

    setup_logging(ctx, config.logging.level, config.logging.progress)
    losses: list[float] = []
    summary = _LossRecorder(losses)
    trainer = Trainer.from_config(config, ctx, [*standard_callbacks(config, resolved), summary])
    log.info(
        "training %s (%s, optim=%s) for %d steps on %s x%d; run dir %s",
        config.model.hub_id or config.model.path or config.model.name,
        trainer.model.config.model_type, config.optim.name, trainer.last_step,
        ctx.device, ctx.world_size, config.run.dir,
    )  # fmt: skip
    trainer.train()
    if losses:
        log.info("first loss %.4f, final loss %.4f", losses[0], losses[-1])
    return {"first_loss": losses[0] if losses else float("nan"),
            "final_loss": losses[-1] if losses else float("nan")}  # fmt: skip


def task_main(name: str, schema: type[TrainerConfig]) -> Callable[[], None]:
    """The ``python -m tasks.<name>`` / ``veoptim-<name>`` entry point (``tasks/cli.py``)."""

    def job(cfg: DictConfig) -> float:
        try:
            return run_task(cfg)["final_loss"]
        except VeoptimError as error:
            logging.getLogger("veoptim").error("%s: %s", type(error).__name__, error)
            sys.exit(2)

    return task_command(name, schema, job)


class _LossRecorder(Callback):
    """Keeps the losses of this process's steps for the end-of-run summary."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        self.losses.append(metrics["loss"])
