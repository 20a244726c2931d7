"""How many processes a parallel config needs, and the torchrun command that starts them.

Started as one plain process (``python -m tasks.sft parallel=fsdp_ep2``), a multi-rank
config would otherwise fail deep in the size checks ("ep=2 must divide dp_shard=1"),
which does not tell a new user that the fix is to launch it with torchrun.
"""

from __future__ import annotations

import shlex
import sys

from hydra.core.hydra_config import HydraConfig

from veoptim.config.schema import ParallelConfig
from veoptim.errors import ConfigError

FILL = -1  # parallel.dp_replicate / dp_shard: fill the rest of the world size


def min_world_size(parallel: ParallelConfig) -> int:
    """The fewest ranks ``parallel`` can run on (its exact size when both degrees are fixed)."""
    replicate = max(parallel.dp_replicate, 1)
    if parallel.dp_shard == FILL:
        return replicate * max(parallel.ep, 1)  # dp_shard must be a multiple of ep
    return replicate * max(parallel.dp_shard, 1)


def launch_command(nproc: int) -> str:
    """``torchrun ... -m tasks.<task> <this run's overrides>`` (from Hydra when it runs).

    The task is Hydra's job name (``tasks/cli.py`` names each job after its task), in the
    package that runs: ``-m tasks.sft`` in a checkout, ``-m veoptim.tasks.sft`` where the
    package is installed (``veoptim-sft``; setup.py ships ``tasks/`` as ``veoptim.tasks``).
    """
    package = "veoptim.tasks" if "veoptim.tasks" in sys.modules else "tasks"
    task, overrides = f"{package}.<task>", "<your overrides>"
    if HydraConfig.initialized():  # a task command (not a programmatic compose)
        hydra = HydraConfig.get()
        task = f"{package}.{hydra.job.name}"  # runs configs/<task>.yaml unless told otherwise
        if hydra.job.config_name != hydra.job.name:  # e.g. a recipe
            task += f" --config-name {shlex.quote(hydra.job.config_name)}"
        overrides = " ".join(shlex.quote(o) for o in hydra.overrides.task)
    return f"torchrun --standalone --nproc_per_node {nproc} -m {task} {overrides}".rstrip()


def check_launch(parallel: ParallelConfig, world_size: int) -> None:
    """Raise ``ConfigError`` with a torchrun command when one process runs a multi-rank config."""
    needed = min_world_size(parallel)
    if world_size != 1 or needed <= 1:
        return
    exact = FILL not in (parallel.dp_replicate, parallel.dp_shard)
    nodes = " (or across nodes: see docs/parallelism.md)" if needed > 8 else ""
    raise ConfigError(
        f"parallel.dp_replicate={parallel.dp_replicate} dp_shard={parallel.dp_shard} "
        f"ep={parallel.ep} needs {'' if exact else 'at least '}{needed} processes, but this is a single process "
        f"(no torchrun); launch it with {launch_command(needed)}{nodes}"
    )
