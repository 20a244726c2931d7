"""The preloaded fork server that test ranks and task commands start from.

Starting a process costs ~5 s of CPU before it does anything (torch, DCP, transformers
and the trainer import), which dominates the tests that run ranks or task commands on a
2-core machine. So each pytest process starts one server (multiprocessing's
``forkserver``) that imports :data:`PRELOAD` once, and a rank (``spawn.py``) or a task
command (:func:`run_module`, :class:`ForkedModule`) is a fork of it. A fork starts with
no state of any earlier rank, command or test: the server only imports, and tokenizes the
bundled data once (``forkserver_warm.py``) as any process may keep it for later reads.

A command forked here behaves as ``python -m MODULE ARGS`` started with the same
environment: ``sys.argv``, ``sys.path``, the working directory and the environment are
set as the interpreter sets them, stdout and stderr go where they were asked to, the exit
status is the interpreter's (``sys.exit``'s code, 1 after an uncaught exception, minus the
signal's number when killed) and the ``atexit`` handlers run. What a fork cannot reproduce
is an environment variable read while :data:`PRELOAD` imports (thread pools, Hub paths,
interpreter flags): a command whose environment differs from the server's in one of
:data:`IMPORT_TIME_ENV` runs as a real interpreter instead. Tests about the process itself
(which modules a command imports, what the interpreter prints at import, peak memory) start
real interpreters with :mod:`subprocess`.
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

#: Imported once by the server: the modules a rank or a task command spends its start on.
#: Name modules, not the lazy packages that re-export them (``veoptim.trainer`` alone
#: imports none of the trainer); ``test_forkserver.py`` checks that the trainer, the model
#: classes and the service are loaded.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "hydra",
    "veoptim.trainer.trainer",
    "veoptim.objectives.sft",
    "veoptim.objectives.dpo",
    "veoptim.lora.inject",
    "veoptim.slots.trainer",
    "veoptim.service.server",
    "pytest",
    "tests.distributed.spawn",
    "tests.forkserver",
    "tests.forkserver_warm",
]

#: Environment variables (names and prefixes) read while the preloaded modules import:
#: thread pools, the Hub's and transformers' paths and modes, interpreter settings. (Not
#: switches a run sets for itself, e.g. progress bars, which a test process may have set;
#: nor ``datasets``' own variables: the server does not import ``datasets``, which
#: ``test_forkserver.py`` checks.)
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "TORCH_", "CUDA_", "HF_HOME", "HF_HUB_", "HF_TOKEN",
                   "HF_ENDPOINT", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "LD_",
                   "MALLOC")  # fmt: skip
#: Interpreter settings a fork applies as the interpreter does at start (``sys.path``,
#: unbuffered standard streams, the fault handler).
APPLIED_IN_FORK = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")

#: The environment the server starts under: the test process's own as ``conftest.py`` leaves
#: it (:func:`set_start_environment`), not what a test has changed for itself at the moment
#: the server happens to start.
_start_env: dict[str, str] | None = None
#: Of that environment, what :data:`PRELOAD` read at import.
_server_env: dict[str, str] | None = None


def set_start_environment(env: Mapping[str, str]) -> None:
    global _start_env
    _start_env = dict(env)


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in APPLIED_IN_FORK
    }


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started (once per pytest process) with
    :data:`PRELOAD` under the start environment."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:
        start = dict(os.environ if _start_env is None else _start_env)
        start.setdefault("OMP_NUM_THREADS", "1")
        ctx.set_forkserver_preload(PRELOAD)
        current = dict(os.environ)
        os.environ.clear()
        os.environ.update(start)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(current)
        _server_env = _import_time(start)
    return ctx


def forkable(env: dict[str, str]) -> bool:
    """Whether a command with ``env`` can be a fork (:func:`unforkable_keys` is empty)."""
    return not unforkable_keys(env)


def unforkable_keys(env: dict[str, str]) -> list[str]:
    """The variables of :data:`IMPORT_TIME_ENV` whose value in ``env`` is not the one the
    server imported under."""
    context()
    wanted = _import_time(env)
    return sorted(k for k in {*wanted, *_server_env} if wanted.get(k) != _server_env.get(k))


# ---------------------------------------------------------------- task commands
def _interpreter_path() -> list[str]:
    """``sys.path`` of a fresh interpreter without ``PYTHONPATH``: the installation's own."""
    roots = (sys.prefix, sys.base_prefix, sys.exec_prefix)
    return [p for p in sys.path if p and p.startswith(roots)]


def _exec_module(module: str, args: list[str], cwd: str, env: dict[str, str],
                 stdout: str, stderr: str | None) -> None:  # fmt: skip
    """In the fork: be ``python -m module args`` in ``cwd`` with ``env``, then exit."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *_interpreter_path()]
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = out if stderr is None else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _standard_streams(*, unbuffered: bool) -> None:
    """New ``sys.stdout`` and ``sys.stderr`` on fds 1 and 2, buffered as a new interpreter
    buffers them there (stdout by blocks, stderr by lines; neither with ``-u``)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=not unbuffered and (name == "stderr" or raw.isatty()),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


class ForkedModule:
    """``subprocess.Popen([python, "-m", module, *args], ...)`` as a fork of the server.

    ``stdout`` is a path or a file opened for writing (appended to), ``stderr`` one too or
    ``subprocess.STDOUT``. The handle has what the tests use of ``Popen``: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``.
    """

    def __init__(self, module: str, args: list[str], *, cwd: Path | str,
                 env: dict[str, str], stdout: Path | str | IO[Any],
                 stderr: Path | str | IO[Any] | int = subprocess.STDOUT) -> None:  # fmt: skip
        self.args = [sys.executable, "-m", module, *args]
        err = None if stderr == subprocess.STDOUT else _path_of(stderr)
        self._process = context().Process(
            target=_exec_module,
            args=(module, list(args), str(cwd), dict(env), _path_of(stdout), err),
            name=f"python -m {module}",
        )
        self._process.start()
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _path_of(target: Path | str | IO[Any]) -> str:
    if isinstance(target, (str, Path)):
        return str(target)
    target.flush()
    return target.name


def run_module(module: str, args: list[str], *, cwd: Path | str, env: dict[str, str],
               timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run([python, "-m", module, *args], capture_output=True, text=True)``,
    forked from the server when ``env`` allows (:func:`forkable`), else a real interpreter."""
    command = [sys.executable, "-m", module, *args]
    if not forkable(env):
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        process = ForkedModule(module, args, cwd=cwd, env=env, stdout=out, stderr=err)
        deadline = time.monotonic() + timeout
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(
            command, process.returncode, out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )  # fmt: skip
