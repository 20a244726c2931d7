"""What every training task does once its config is composed: set up, train, tear down."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from callbacks import standard_callbacks
from veoptim.config import to_sft_config
from veoptim.distributed import init_distributed, setup_logging
from veoptim.trainer import Callback, Metrics, Trainer

log = logging.getLogger("veoptim")


def run_dir_of_job(cfg: DictConfig) -> str:
    """Hydra's output dir of this job: ``run.dir`` for a single run, ``run.dir/<n>`` in a sweep."""
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.output_dir
    return cfg.run.dir


def run_sft(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> dict[str, float]:
    """Train from a composed config; returns the first and last logged loss."""
    cfg = cfg.copy()
    cfg.run.dir = run_dir_of_job(cfg)
    sft = to_sft_config(cfg)
    resolved = OmegaConf.to_container(OmegaConf.structured(sft), resolve=True)
    ctx = init_distributed(sft.run.device, sft.parallel.backend, env)
    try:
        setup_logging(ctx, sft.logging.level)
        losses: list[float] = []
        summary = _LossRecorder(losses)
        trainer = Trainer.from_config(sft, ctx, [*standard_callbacks(sft, resolved), summary])
        log.info(
            "training %s (%s, optim=%s) for %d steps on %s x%d; run dir %s",
            sft.model.name, sft.model.arch, sft.optim.name, trainer.last_step,
            ctx.device, ctx.world_size, sft.run.dir,
        )  # fmt: skip
        trainer.train()
        if losses:
            log.info("first loss %.4f, final loss %.4f", losses[0], losses[-1])
        return {"first_loss": losses[0] if losses else float("nan"),
                "final_loss": losses[-1] if losses else float("nan")}  # fmt: skip
    finally:
        ctx.close()


class _LossRecorder(Callback):
    """Keeps the losses of this process's steps for the end-of-run summary."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        self.losses.append(metrics["loss"])
