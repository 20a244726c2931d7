"""The test harness's ranks: forked from a preloaded server, yet in the caller's environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed.spawn import run_ranks

pytestmark = pytest.mark.slow


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


def _abort_on_rank1(ctx, out: Path) -> dict:
    if ctx.rank == 1:
        os.write(2, b"terminate called without an active exception\n")  # as native code would
        os.abort()
    return {"rank": ctx.rank}


def test_a_rank_killed_by_a_signal_is_reported_with_its_signal_and_stderr(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, _abort_on_rank1, tmp_path)
    report = str(failure.value)
    first = report.splitlines()[0]
    assert "process 1 terminated with signal SIGABRT" in first, first
    assert "terminate called without an active exception" in report
    assert "Fatal Python error: Aborted" in report  # the fault handler's stacks follow
    assert "_abort_on_rank1" in report
