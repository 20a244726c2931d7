"""The test harness's ranks: forked from a preloaded server, yet in the caller's environment."""

from __future__ import annotations

import os
from pathlib import Path

from tests.distributed.spawn import run_ranks


def _environment(ctx, out: Path) -> dict:
    return {"marker": os.environ.get("VEOPTIM_TEST_MARKER"), "rank": ctx.rank}


def test_a_rank_sees_the_environment_of_the_call_not_of_the_fork_servers_start(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("VEOPTIM_TEST_MARKER", raising=False)
    before = run_ranks(2, _environment, tmp_path / "before")  # starts the fork server
    monkeypatch.setenv("VEOPTIM_TEST_MARKER", "set after the server started")
    after = run_ranks(2, _environment, tmp_path / "after")
    assert before == {"marker": None, "rank": 0}
    assert after == {"marker": "set after the server started", "rank": 0}
