"""Trainer callbacks: progress, metrics/wandb, resolved config, checkpoints and exports.

Importing the package loads no callback module (they import torch and the checkpoint
stack): a task command imports it before its config is checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from veoptim.config.schema import TrainerConfig
    from veoptim.trainer import Callback


def standard_callbacks(cfg: TrainerConfig, resolved: dict[str, Any]) -> list[Callback]:
    """The callbacks every task uses, in hook order: run files, metrics, checkpoints, progress."""
    from .checkpoint import CheckpointCallback
    from .hf_export import HFExportCallback
    from .metrics import MetricsFileCallback, TensorBoardCallback, WandbCallback
    from .progress import ProgressCallback
    from .run_files import ResolvedConfigCallback

    # Metrics before checkpoints: a step's record is written before that step's checkpoint
    # is published, so a crash between them never leaves a checkpoint missing from the log.
    callbacks: list[Callback] = [
        ResolvedConfigCallback(resolved),
        MetricsFileCallback(cfg.logging),
        WandbCallback(cfg.logging, resolved),
        TensorBoardCallback(cfg.logging),
        CheckpointCallback(cfg.checkpoint),
    ]
    if cfg.logging.progress:
        callbacks.append(ProgressCallback())
    if cfg.export.hf:
        callbacks.append(HFExportCallback(cfg.export, fsync=cfg.checkpoint.fsync))
    return callbacks


__all__ = ["standard_callbacks"]
