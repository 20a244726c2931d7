"""A task command (``veoptim-sft``, ``python -m tasks.sft``, ...): Hydra plus our ``--help``.

Hydra's ``--help`` lists only config groups, so ``--help``/``-h`` is answered here, before
Hydra parses the command line, by ``tasks/usage.py`` (every key, its type, default and
meaning); Hydra's own help stays available as ``--hydra-help``. A command line whose
config does not compose (a mistyped key, group option or type, on the command line or in a
config file of ``--config-dir``) is answered with one line and exit status 2 by
``tasks/overrides.py``, also before Hydra runs; that check also gives Hydra the output dirs
and log format a primary config leaves at Hydra's defaults (its ``run.dir``, veoptim's).
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

from veoptim.config import TrainerConfig, register_schema

from .compose import CONFIG_DIR
from .overrides import check_command_line, rank_prefix
from .usage import config_dir_of, config_name_of, render_help

HELP_FLAGS = ("--help", "-h")


def prog_name(task: str, argv0: str) -> str:
    """``veoptim-sft`` when run as the installed command, else ``python -m tasks.sft``
    (``python -m veoptim.tasks.sft`` where the package is installed: see setup.py)."""
    name = Path(argv0).name
    return name if name.startswith("veoptim-") else f"python -m {__package__}.{task}"


def print_help(task: str, schema: type[TrainerConfig], argv: list[str]) -> int:
    """Print the help; 2 with a one-line error when its config (``--config-name``) won't compose."""
    config_name = config_name_of(argv, task)
    try:
        text = render_help(
            task, schema, prog_name(task, sys.argv[0]), config_name, config_dir_of(argv)
        )
    except (HydraException, OmegaConfBaseException) as error:
        reason = str(error).strip().splitlines()[0]
        print(f"error: config {config_name!r} does not compose: {reason}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def task_command(
    task: str, schema: type[TrainerConfig], job: Callable[[DictConfig], Any]
) -> Callable[[], None]:
    """The entry point running ``job`` on ``configs/<task>.yaml`` composed by Hydra."""
    register_schema(task, schema)
    # Hydra names the job after the task function's module: tasks.sft -> "sft" is
    # hydra.job.name (the run dir's sft.log, the task in launch.py's torchrun hint).
    job.__module__ = f"{__package__}.{task}"
    hydra_main = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name=task)(job)

    def main() -> None:
        argv = sys.argv[1:]
        if any(arg in HELP_FLAGS for arg in argv):
            sys.exit(print_help(task, schema, argv))
        # Mistyped keys, unknown group options and wrong types: one line, exit 2, before
        # Hydra (which would print 7-13 lines, exit 1 and advise '+key=...').
        checked = check_command_line(task, schema, argv, prog_name(task, sys.argv[0]))
        if checked.problem:
            print(f"{rank_prefix()}error: {checked.problem}", file=sys.stderr)
            sys.exit(2)
        sys.argv = [sys.argv[0], *argv, *checked.hydra_overrides]  # Hydra reads sys.argv
        hydra_main()

    return main
