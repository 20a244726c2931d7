"""Shared fixtures: composing configs exactly as `python -m tasks.sft` does, offline."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tasks.compose import compose_config
from tests import forkserver

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# One intra-op thread per process: ``make test`` runs two workers on two cores, each with
# the processes its tests start, and torch's default (a thread per core in every process)
# oversubscribes the cores while idle OpenMP threads spin (the suite ran ~1.5x longer).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): apply it there too
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Task commands and ranks fork from a server started under this environment, whichever test
# first needs it (tests/forkserver.py).
forkserver.set_start_environment(os.environ)

#: Modules that share one costly setup through the session (a cache or the session's temp
#: dir): ``make test``'s parallel run gives them to one worker, so the setup runs once.
SHARED_SETUP = {
    "checkpoint/test_reshard.py": "resume campaign",
    "checkpoint/test_resume_equivalence.py": "resume campaign",
    "distributed/test_agreement.py": "multirank publication",
    "checkpoint/test_publish_multirank.py": "multirank publication",
}

#: Queued first: the docs walkthrough is the longest single test, and the other worker
#: works through the rest meanwhile.
FIRST = "test_docs_walkthrough.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Queue the slow tier first, :data:`FIRST` at its head (the order within each tier
    unchanged), so that in ``make test``'s parallel run the long modules start early and
    the short ones fill in at the end.

    A module declares its tier itself: ``pytestmark = pytest.mark.slow`` (or ``slow`` in its
    ``pytestmark`` list) puts it in the slow tier, which ``make test-fast`` leaves out. A
    module of :data:`SHARED_SETUP` that no longer exists is an error, so a rename cannot
    split a shared setup unseen.
    """
    missing = [m for m in SHARED_SETUP if not (REPO / "tests" / m).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py lists missing test files: {missing}")
    first = REPO / "tests" / FIRST
    items.sort(key=lambda item: (item.path != first, not declared_slow(item)))


def declared_slow(item: pytest.Item) -> bool:
    """Whether the module of ``item`` declares the slow tier (its ``pytestmark``): the
    whole module goes with it, so a module's tests stay together."""
    module = item.getparent(pytest.Module)
    return module is not None and any(m.name == "slow" for m in module.iter_markers())


# ---------------------------------------------------------------- the fast tier's processes
#: The test running now (setup, call or teardown), while the process guard watches.
_RUNNING: list[pytest.Item] = []


def starts_processes_allowed(item: pytest.Item) -> bool:
    """A module may start processes if it declares the slow tier or, in the fast tier,
    ``pytest.mark.starts_processes`` or ``multirank`` (its ``pytestmark``)."""
    module = item.getparent(pytest.Module)
    names = {m.name for m in module.iter_markers()} if module is not None else set()
    return bool(names & {"slow", "starts_processes", "multirank"})


def _guarded(original, what: str):
    def start(*args, **kwargs):
        if _RUNNING and not starts_processes_allowed(_RUNNING[-1]):
            raise RuntimeError(
                f"{_RUNNING[-1].nodeid} starts a process ({what}) but its module declares "
                "neither `pytestmark = pytest.mark.slow` nor `pytest.mark.starts_processes`: "
                "declare one (and name a fast-tier one in the README's list)."
            )
        return original(*args, **kwargs)

    return start


def pytest_configure(config: pytest.Config) -> None:
    """Every start of a process (``subprocess``, ``multiprocessing``, the fork server,
    torch's spawn) fails a test whose module does not declare it: the tiers are declared
    where the tests are, and the fast tier's processes are known. The native AdamW kernel
    is built (or found in its cache) first, outside any test: its compiler runs are the
    session's, not a test's."""
    from veoptim.optim.kernels.native import native_kernel

    native_kernel()
    subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__, "subprocess.Popen")
    multiprocessing.process.BaseProcess.start = _guarded(
        multiprocessing.process.BaseProcess.start, "multiprocessing"
    )


@contextmanager
def _watching(item: pytest.Item) -> Iterator[None]:
    _RUNNING.append(item)
    try:
        yield
    finally:
        _RUNNING.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _watching(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _watching(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _watching(item):
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (``make test``), with the modules of :data:`SHARED_SETUP` as one unit.

    Each module goes to one worker whole, so its module-scoped fixtures run once; modules
    that share a session-wide setup go together.
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ModuleScheduling(config, log)


def work_unit(nodeid: str) -> str:
    """The unit of ``make test``'s parallel run a test belongs to: its module, or the
    shared name of :data:`SHARED_SETUP`'s modules."""
    module = nodeid.split("::", 1)[0]
    return SHARED_SETUP.get(module.removeprefix("tests/"), module)


def compose_sft(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``configs/sft.yaml`` with overrides (the same schema validation as the CLI)."""
    return compose_config("sft", overrides)


def run_task_cli(
    task: str, args: list[str], cwd: Path, *, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``python -m tasks.<task> ARGS``, offline, from ``cwd``: a fork of the preloaded server
    (``tests/forkserver.py``), or with ``fresh=True`` a new interpreter, for checks of all
    it prints (a one-line error is one line also with what importing prints)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if not fresh:
        return forkserver.run_module(f"tasks.{task}", args, cwd=cwd, env=env, timeout=300)
    return subprocess.run(
        [sys.executable, "-m", f"tasks.{task}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_sft_cli(args: list[str], cwd: Path, *, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m tasks.sft ARGS`` (see :func:`run_task_cli`)."""
    return run_task_cli("sft", args, cwd, fresh=fresh)


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    """A few-step CPU run in a temporary run dir, without progress bar."""
    return [
        f"run.dir={tmp_path / 'run'}",
        "run.device=cpu",
        "train.max_steps=4",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "scheduler.warmup_steps=1",
        "logging.progress=false",
        "export.hf=false",
    ]
