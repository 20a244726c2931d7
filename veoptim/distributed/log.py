"""Rank-aware logging: rank 0 logs at the configured level, other ranks warnings only."""

from __future__ import annotations

import logging
import sys

from veoptim.distributed.context import DistContext
from veoptim.errors import ConfigError

HANDLER_NAME = "veoptim-rank-aware"
SINGLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MULTI_FORMAT = "[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(ctx: DistContext, level: str | int = "INFO") -> logging.Logger:
    """Configure the root logger for this rank; calling it again reconfigures, never duplicates.

    Multi-rank runs prefix every line with the rank so interleaved output stays readable.
    """
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ConfigError(
                f"logging.level must be a logging level name such as INFO or DEBUG, got {level!r}."
            )
        level = resolved
    root = logging.getLogger()
    handler = next((h for h in root.handlers if h.get_name() == HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        root.addHandler(handler)
    fmt = MULTI_FORMAT.format(rank=ctx.rank) if ctx.world_size > 1 else SINGLE_FORMAT
    handler.setFormatter(logging.Formatter(fmt))
    root.setLevel(level if ctx.is_main else max(level, logging.WARNING))
    return root
