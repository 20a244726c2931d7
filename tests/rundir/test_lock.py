"""One writer per run dir: a second one is refused naming the holder, a killed holder's
record is taken over, and an unusable run dir is one clear error. Real processes, real
``flock``."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from tests.rundir.holder import hold, stop
from veoptim.errors import ConfigError
from veoptim.rundir import LOCK_FILE, RunDirInUseError, RunDirLock, holder_of, locked_run_dir

pytestmark = pytest.mark.starts_processes


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = hold(tmp_path)
    try:
        with pytest.raises(RunDirInUseError) as refused:
            RunDirLock.acquire(tmp_path, "this run")
        message = str(refused.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in message
        assert "started 20" in message and "another run.dir" in message
        assert "\n" not in message
        found = holder_of(tmp_path)
        assert found is not None and found.pid == holder.pid
    finally:
        stop(holder)


def test_a_killed_holder_is_taken_over_and_the_log_says_whose(tmp_path: Path, caplog) -> None:
    holder = hold(tmp_path)
    stop(holder)  # SIGKILL: no cleanup ran, its record stays in run.lock
    assert str(holder.pid) in (tmp_path / LOCK_FILE).read_text()
    assert holder_of(tmp_path) is None
    with caplog.at_level(logging.WARNING), RunDirLock.acquire(tmp_path) as lock:
        assert lock.held
        assert f"{os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
    assert f"took over the stale lock of pid {holder.pid}" in caplog.text
    assert "gone" in caplog.text


def test_release_frees_the_dir_for_the_next_writer_and_keeps_the_file(tmp_path: Path) -> None:
    with RunDirLock.acquire(tmp_path):
        assert holder_of(tmp_path) is not None
    assert holder_of(tmp_path) is None
    assert (tmp_path / LOCK_FILE).read_text() == ""  # cleared, never unlinked
    with locked_run_dir(tmp_path):  # no stale record, nothing to take over
        with pytest.raises(RunDirInUseError):
            RunDirLock.acquire(tmp_path)  # another open file: refused in one process too


@pytest.mark.parametrize("kind", ["file", "below_a_device", "unwritable"])
def test_an_unusable_run_dir_is_one_clear_error(tmp_path: Path, kind: str) -> None:
    if kind == "file":
        run_dir = tmp_path / "a_file"
        run_dir.write_text("")
    elif kind == "below_a_device":
        run_dir = Path("/dev/null/run")  # not a directory, even for root
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o500)
        run_dir = parent / "run"
    with pytest.raises(ConfigError, match=r"run.dir .* cannot be used") as refused:
        RunDirLock.acquire(run_dir)
    assert "\n" not in str(refused.value)
