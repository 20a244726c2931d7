"""Writes the resolved config into the run directory, so a run can be reproduced from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from veoptim.trainer import Callback, Trainer

RESOLVED_CONFIG_FILE = "config.yaml"


def write_resolved_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Write ``<run_dir>/config.yaml``, the resolved config (keys in schema order)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESOLVED_CONFIG_FILE
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class ResolvedConfigCallback(Callback):
    """Saves ``<run.dir>/config.yaml`` (rank 0) at train begin."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.ctx.is_main:
            write_resolved_config(trainer.run_dir, self.config)
