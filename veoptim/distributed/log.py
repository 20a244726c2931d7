"""Rank-aware logging with one line format for every phase of a run.

Rank 0 logs at the configured level, other ranks warnings only. Every line, whoever
emits it, reads ``[rank1] 2026-01-31 12:00:00,000 INFO veoptim: message`` (the rank
prefix only when several ranks share a console):

- before ``setup_logging`` runs, Hydra's job logging uses ``RankFormatter`` too
  (``configs/hydra/job_logging/veoptim.yaml``, selected by every task config);
- ``setup_logging`` gives the handlers already on the root logger (Hydra's console and
  run-dir file) the rank-aware format and adds a console handler only when there is
  none, so lines are never duplicated;
- transformers and huggingface_hub print through handlers of their own
  (``[transformers] message``): those are removed and their records propagate to ours;
- Python warnings become one-line ``py.warnings`` records instead of two raw lines;
- the libraries' progress bars are drawn only where veoptim's is (rank 0, unless
  ``logging.progress=false``);
- a console line takes the progress bars off the screen while it is written and draws them
  again below it (``ConsoleHandler``), so it never continues the bar's line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

from veoptim.errors import ConfigError

if TYPE_CHECKING:
    from veoptim.distributed.context import DistContext

HANDLER_NAME = "veoptim-rank-aware"
SINGLE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MULTI_FORMAT = "[rank{rank}] " + SINGLE_FORMAT
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
WARNINGS_LOGGER = "py.warnings"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class RankFormatter(logging.Formatter):
    """veoptim's line format; ``[rankN]`` first when the job has several ranks.

    Without arguments (Hydra builds it from YAML, before the process group exists) the
    rank and world size come from the launcher's ``RANK`` and ``WORLD_SIZE``.
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        rank = _env_int("RANK", 0) if rank is None else rank
        world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        super().__init__(MULTI_FORMAT.format(rank=rank) if world_size > 1 else SINGLE_FORMAT)


class ConsoleHandler(logging.StreamHandler):
    """A console handler that writes each line with tqdm's bars cleared and redraws them
    below it: the bar (on stderr) ends without a newline, and a line written after it on a
    shared terminal (stdout or stderr) would continue the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def _bar_safe(handler: logging.Handler) -> logging.Handler:
    """``handler`` as a :class:`ConsoleHandler` (same stream, name, level, formatter and
    filters) when it is a plain console handler (Hydra's, say); else itself."""
    if isinstance(handler, ConsoleHandler) or not _is_console(handler):
        return handler
    safe = ConsoleHandler(handler.stream)
    safe.set_name(handler.get_name())
    safe.setLevel(handler.level)
    safe.setFormatter(handler.formatter)
    safe.filters = list(handler.filters)
    return safe


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


def _adopt_library_loggers() -> None:
    """Route transformers' and huggingface_hub's records through the root handlers."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()  # attaches it first if not yet done
    transformers_logging.enable_propagation()
    hub = logging.getLogger("huggingface_hub")  # its handler prints bare messages, then propagates
    for handler in [h for h in hub.handlers if type(h) is logging.StreamHandler]:
        hub.removeHandler(handler)
    hub.propagate = True


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` as one log line (the default prints the source line too)."""
    text = " ".join(str(message).split())
    logging.getLogger(WARNINGS_LOGGER).warning(
        "%s: %s (%s:%d)", category.__name__, text, filename, lineno
    )


def disable_library_progress_bars() -> None:
    """transformers' "Loading weights" bar (every rank draws one), the Hub's download bars and
    datasets' tokenization bars (their warnings and errors still show)."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    # datasets reads this when first imported (the data path imports it lazily) ...
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "datasets" in sys.modules:  # ... and needs telling if it already was
        sys.modules["datasets"].disable_progress_bars()


def setup_logging(
    ctx: DistContext, level: str | int = "INFO", progress: bool = True
) -> logging.Logger:
    """Configure the root logger for this rank; calling it again reconfigures, never duplicates.

    Multi-rank runs prefix every line with the rank so interleaved output stays readable.
    ``progress=False`` (``logging.progress=false``) also silences the libraries' progress
    bars, which other ranks never show.
    """
    resolved = _resolve_level(level)
    root = logging.getLogger()
    if not any(_is_console(h) for h in root.handlers):
        handler = ConsoleHandler(sys.stderr)
        handler.set_name(HANDLER_NAME)
        root.addHandler(handler)
    root.handlers[:] = [_bar_safe(h) for h in root.handlers]  # in place: Hydra's order
    for handler in root.handlers:
        if _is_console(handler) or isinstance(handler, logging.FileHandler):
            handler.setFormatter(RankFormatter(ctx.rank, ctx.world_size))
    root.setLevel(resolved if ctx.is_main else max(resolved, logging.WARNING))
    _adopt_library_loggers()
    warnings.showwarning = _log_warning
    if not progress or not ctx.is_main:
        disable_library_progress_bars()
    # Gathering a 2-D (efsdp x ep) expert DTensor for an export takes two all-gathers, and
    # torch warns on every rank that their "reduction order" may differ: an all-gather has
    # none (the gathered experts are checked bitwise in tests), so the warning is noise.
    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    return root
