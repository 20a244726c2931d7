"""A real process holding a run dir's lock, for the lock tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def hold(run_dir: Path) -> subprocess.Popen:
    """Start a holder of ``run_dir``'s lock; returns once it holds the lock."""
    code = (
        "import os, sys, time\n"
        "from veoptim.rundir import RunDirLock\n"
        "lock = RunDirLock.acquire(sys.argv[1])\n"
        "print('locked', os.getpid(), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    line = process.stdout.readline()
    assert line.startswith("locked"), line
    return process


def stop(process: subprocess.Popen) -> None:
    """SIGKILL the holder and reap it (the kernel drops its lock)."""
    process.kill()
    process.wait(timeout=30)
    process.stdout.close()
