"""Rank-aware logging: rank 0 at the configured level, others warnings only, rank prefix, no duplicates."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from veoptim.distributed import DistContext, setup_logging
from veoptim.errors import ConfigError


def _ctx(rank: int, world_size: int) -> DistContext:
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        device=torch.device("cpu"),
        backend="gloo",
    )


def _rank_logging_output(
    rank: int, world_size: int, capsys, existing: logging.Handler | None = None
) -> str:
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        device=torch.device("cpu"),
        backend="gloo",
    )
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    if existing is not None:
        root.addHandler(existing)
    try:
        setup_logging(ctx, "INFO")
        setup_logging(ctx, "INFO")  # idempotent: still one handler
        log = logging.getLogger("veoptim.test")
        log.info("info line")
        log.warning("warning line")
        return capsys.readouterr().err
    finally:
        root.handlers[:] = saved_handlers  # setup_logging may have replaced ``existing``
        root.setLevel(saved_level)


def test_rank_zero_logs_at_the_configured_level_with_rank_prefix(capsys):
    err = _rank_logging_output(0, 2, capsys)
    assert err.count("info line") == 1 and "[rank0]" in err


def test_other_ranks_log_warnings_only(capsys):
    err = _rank_logging_output(1, 2, capsys)
    assert "info line" not in err and "[rank1]" in err and "warning line" in err


def test_single_process_logs_have_no_rank_prefix(capsys):
    err = _rank_logging_output(0, 1, capsys)
    assert "info line" in err and "[rank" not in err


def test_unknown_log_level_is_rejected():
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )
    with pytest.raises(ConfigError, match="logging.level"):
        setup_logging(ctx, "LOUD")


def test_an_existing_console_handler_is_reused_not_duplicated(capsys):
    """Hydra installs a console handler on the root logger; lines must not appear twice."""
    err = _rank_logging_output(0, 2, capsys, existing=logging.StreamHandler(sys.stderr))
    assert err.count("info line") == 1 and "[rank0]" in err
