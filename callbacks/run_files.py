"""Writes the resolved config into the run directory, so a run can be reproduced from it."""

from __future__ import annotations

from typing import Any

import yaml

from veoptim.trainer import Callback, Trainer

RESOLVED_CONFIG_FILE = "config.yaml"


class ResolvedConfigCallback(Callback):
    """Saves ``<run.dir>/config.yaml`` (rank 0) at train begin."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.ctx.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            path = trainer.run_dir / RESOLVED_CONFIG_FILE
            path.write_text(yaml.safe_dump(self.config, sort_keys=False))
