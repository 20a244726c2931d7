"""A task command forked from the preloaded server behaves as ``python -m`` in a new interpreter.

The suite runs most task commands and every spawned rank as forks of one server per
pytest process (``tests/forkserver.py``); these checks compare a probe module run both
ways, and check that the server really holds what the forks would otherwise import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import REPO

pytestmark = pytest.mark.slow

PROBE = """
import atexit, json, os, sys, threading, time
from pathlib import Path

print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[:2], "name": __name__,
    "env": os.environ.get("PROBE_VALUE"), "preloaded": sorted(m for m in sys.modules if m in
    ("torch", "transformers", "veoptim.trainer.trainer", "veoptim.models.build",
     "veoptim.service.server", "datasets")),
    "memo": len(sys.modules["veoptim.data.token_memo"].TOKENIZED)
            if "veoptim.data.token_memo" in sys.modules else 0}), flush=True)
atexit.register(lambda: Path("atexit.txt").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), Path("thread.txt").write_text("ran"))).start()
mode = sys.argv[1]
if mode == "raise":
    raise ValueError("probe failed")
if mode == "wait":
    time.sleep(600)
print("to stderr", file=sys.stderr)
sys.exit(int(mode))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PROBE_VALUE": "x", **extra}


def _probe_dir(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "probe_module.py").write_text(PROBE)
    return run


def _both(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, ...]:
    fresh_dir, fork_dir = _probe_dir(tmp_path, "fresh"), _probe_dir(tmp_path, "fork")
    fresh = subprocess.run([sys.executable, "-m", "probe_module", mode], cwd=fresh_dir,
                           env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert forkserver.unforkable_keys(_env()) == []  # else the "fork" is a new interpreter
    fork = forkserver.run_module("probe_module", [mode], cwd=fork_dir, env=_env(), timeout=120)
    return fresh, fork


def _report(proc: subprocess.CompletedProcess, run: Path) -> dict:
    report = json.loads(proc.stdout.splitlines()[0])
    for key in ("argv", "cwd", "path0"):
        report[key] = json.loads(json.dumps(report[key]).replace(str(run), "<run>"))
    return report


def test_a_fork_runs_a_module_as_a_new_interpreter_does(tmp_path):
    fresh, fork = _both(tmp_path, "3")
    assert (fresh.returncode, fork.returncode) == (3, 3)
    assert (fresh.stderr, fork.stderr) == ("to stderr\n", "to stderr\n")
    fresh_report, fork_report = _report(fresh, tmp_path / "fresh"), _report(fork, tmp_path / "fork")
    assert fresh_report["preloaded"] == []  # the control: a new interpreter imports nothing
    # not datasets: its HF_DATASETS_* variables are read when a command imports it
    assert fork_report["preloaded"] == [
        "torch", "transformers", "veoptim.models.build", "veoptim.service.server",
        "veoptim.trainer.trainer"]  # fmt: skip
    # the bundled SFT data and both sides of the bundled pairs, tokenized by the server
    assert (fresh_report["memo"], fork_report["memo"]) == (0, 3)
    del (
        fresh_report["preloaded"],
        fork_report["preloaded"],
        fresh_report["memo"],
        fork_report["memo"],
    )
    assert fork_report == fresh_report
    assert fork_report["argv"] == ["<run>/probe_module.py", "3"]
    assert fork_report["path0"] == ["<run>", str(REPO)] and fork_report["name"] == "__main__"
    for run in ("fresh", "fork"):  # non-daemon threads are joined, then atexit handlers run
        assert (tmp_path / run / "thread.txt").read_text() == "ran"
        assert (tmp_path / run / "atexit.txt").read_text() == "ran"


def test_an_uncaught_exception_exits_1_with_its_traceback(tmp_path):
    fresh, fork = _both(tmp_path, "raise")
    assert (fresh.returncode, fork.returncode) == (1, 1)
    for proc in (fresh, fork):
        assert proc.stderr.startswith("Traceback") and proc.stderr.endswith(
            "ValueError: probe failed\n"
        )


def test_a_signal_ends_a_fork_with_minus_its_number(tmp_path):
    run = _probe_dir(tmp_path, "fork")
    process = forkserver.ForkedModule("probe_module", ["wait"], cwd=run, env=_env(),
                                      stdout=run / "out.txt")  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run / "out.txt").exists() or not (run / "out.txt").read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    assert process.poll() is None
    process.send_signal(signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL == process.returncode


def test_switches_a_run_sets_for_itself_still_allow_a_fork(monkeypatch):
    """A test process that ran the trainer in-process holds what a run sets for itself
    (progress bars off, torch's compiler cache dir): its commands are still forks."""
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    assert forkserver.unforkable_keys(_env()) == []
    monkeypatch.setenv("HF_HUB_CACHE", "/tmp/another_cache")
    assert forkserver.unforkable_keys(_env()) == ["HF_HUB_CACHE"]


def test_an_environment_the_server_did_not_import_under_gets_a_new_interpreter(tmp_path):
    run = _probe_dir(tmp_path, "other")
    threads = "2" if os.environ.get("OMP_NUM_THREADS") != "2" else "3"
    assert not forkserver.forkable(_env(OMP_NUM_THREADS=threads))
    proc = forkserver.run_module("probe_module", ["0"], cwd=run,
                                 env=_env(OMP_NUM_THREADS=threads))  # fmt: skip
    assert proc.returncode == 0 and _report(proc, run)["preloaded"] == []


FIRST_START = """
import os
from tests import forkserver
forkserver.PRELOAD[:] = []  # the start environment is the point, not the imports
forkserver.set_start_environment(os.environ)
baseline = dict(os.environ)
os.environ["HF_HOME"] = "/tmp/a_tests_own_hf_home"  # as monkeypatch.setenv would
forkserver.context()
print(forkserver.unforkable_keys(baseline), forkserver.unforkable_keys(os.environ))
"""


def test_the_server_starts_under_the_start_environment_not_a_tests_changes():
    """The server starts when a test first needs it; one that changed the environment for
    itself then does not make every later command a new interpreter."""
    proc = subprocess.run([sys.executable, "-c", FIRST_START], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[] ['HF_HOME']"
