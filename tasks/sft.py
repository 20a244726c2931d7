"""Supervised fine-tuning: ``python -m tasks.sft [key=value ...]`` (or under torchrun)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from tasks.runner import run_sft
from veoptim.config import register_configs
from veoptim.errors import VeoptimError

register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="sft")
def main(cfg: DictConfig) -> float:
    try:
        return run_sft(cfg)["final_loss"]
    except VeoptimError as error:
        logging.getLogger("veoptim").error("%s: %s", type(error).__name__, error)
        sys.exit(2)


if __name__ == "__main__":
    main()
