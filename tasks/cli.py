"""A task command (``veoptim-sft``, ``python -m tasks.sft``, ...): Hydra plus our ``--help``.

Hydra's ``--help`` lists only config groups, so ``--help``/``-h`` is answered here, before
Hydra parses the command line, by ``tasks/usage.py`` (every key, its type, default and
meaning); Hydra's own help stays available as ``--hydra-help``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from tasks.compose import CONFIG_DIR
from tasks.usage import config_name_of, render_help
from veoptim.config import TrainerConfig, register_schema

HELP_FLAGS = ("--help", "-h")


def prog_name(task: str, argv0: str) -> str:
    """``veoptim-sft`` when run as the installed command, else ``python -m tasks.sft``."""
    name = Path(argv0).name
    return name if name.startswith("veoptim-") else f"python -m tasks.{task}"


def print_help(task: str, schema: type[TrainerConfig], argv: list[str]) -> int:
    """Print the help; 2 with a one-line error when its config (``--config-name``) won't compose."""
    config_name = config_name_of(argv, task)
    try:
        text = render_help(task, schema, prog_name(task, sys.argv[0]), config_name)
    except (HydraException, OmegaConfBaseException) as error:
        reason = str(error).strip().splitlines()[0]
        print(f"error: config {config_name!r} does not compose: {reason}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def task_command(
    task: str, schema: type[TrainerConfig], job: Callable[[DictConfig], Any]
) -> Callable[[], None]:
    """The entry point running ``job`` on ``veoptim/configs/<task>.yaml`` composed by Hydra."""
    register_schema(task, schema)
    # Hydra names the job after the task function's module: tasks.sft -> "sft" is
    # hydra.job.name (the run dir's sft.log, the task in launch.py's torchrun hint).
    job.__module__ = f"tasks.{task}"
    hydra_main = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=task)(job)

    def main() -> None:
        argv = sys.argv[1:]
        if any(arg in HELP_FLAGS for arg in argv):
            sys.exit(print_help(task, schema, argv))
        hydra_main()

    return main
