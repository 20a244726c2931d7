"""Rank-aware logging: rank 0 logs at the configured level, other ranks warnings only.

Works with or without Hydra's job logging: handlers already on the root logger
(Hydra's console and file handlers) get the rank-aware format, and a console
handler is added only when there is none, so lines are never duplicated.
"""

from __future__ import annotations

import logging
import sys

from veoptim.distributed.context import DistContext
from veoptim.errors import ConfigError

HANDLER_NAME = "veoptim-rank-aware"
SINGLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MULTI_FORMAT = "[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s"
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stderr,
        sys.stdout,
    )


def _resolve_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    resolved = logging.getLevelName(level.upper())
    if not isinstance(resolved, int):
        raise ConfigError(
            f"logging.level must be a logging level name such as INFO or DEBUG, got {level!r}."
        )
    return resolved


def setup_logging(ctx: DistContext, level: str | int = "INFO") -> logging.Logger:
    """Configure the root logger for this rank; calling it again reconfigures, never duplicates.

    Multi-rank runs prefix every line with the rank so interleaved output stays readable.
    """
    resolved = _resolve_level(level)
    root = logging.getLogger()
    if not any(_is_console(h) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        root.addHandler(handler)
    fmt = MULTI_FORMAT.format(rank=ctx.rank) if ctx.world_size > 1 else SINGLE_FORMAT
    for handler in root.handlers:
        if _is_console(handler) or isinstance(handler, logging.FileHandler):
            handler.setFormatter(logging.Formatter(fmt))
    root.setLevel(resolved if ctx.is_main else max(resolved, logging.WARNING))
    # Gathering a 2-D (efsdp x ep) expert DTensor for an export takes two all-gathers, and
    # torch warns on every rank that their "reduction order" may differ: an all-gather has
    # none (the gathered experts are checked bitwise in tests), so the warning is noise.
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    return root
