"""``python -m tinker_cookbook.recipes.math_rl.train`` with the same ``key=value`` command
line, with the cookbook's pricing download switched off: the test machine has no network
and the run must not try (every request of a test goes to the loopback server)."""

from __future__ import annotations

import asyncio

import chz
import tinker_cookbook.utils.cost_estimation as cost_estimation
from tinker_cookbook.recipes.math_rl import train

from tests.service.helpers import run_and_exit

if __name__ == "__main__":
    cost_estimation._pricing_fetched = True
    run_and_exit(lambda: asyncio.run(train.cli_main(chz.entrypoint(train.CLIConfig))))
