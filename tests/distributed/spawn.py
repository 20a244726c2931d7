"""Run a function on N gloo ranks (torch.multiprocessing.spawn) and collect rank 0's JSON result.

Process start dominates multi-rank tests, so each spawn runs a whole batch of
checks and returns their measurements; the test functions then assert on them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests import forkserver
from veoptim.distributed import init_distributed
from veoptim.distributed.context import (
    import_group_capturing_modules,
    live_process_group_threads,
    release_frames,
    release_process_groups,
)

RESULT_FILE = "result.rank{rank}.json"
ERROR_FILE = "error.rank{rank}.txt"
#: A rank's standard error, where a native abort ("terminate called ...") and the fault
#: handler's thread stacks land: a rank killed by a signal leaves no error file.
STDERR_FILE = "stderr.rank{rank}.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun would export for this rank (passed explicitly, as tasks pass os.environ)."""
    return {
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@contextlib.contextmanager
def own_process_group(
    rank: int, world_size: int, init_method: str, **kwargs: Any
) -> Iterator[None]:
    """A gloo default group for a worker that sets one up itself, released on the way out.

    Put the worker's checks in a function called inside the block: its locals (models, device
    meshes) hold the groups, and only once it has returned can :func:`release_process_groups`
    join their threads. A group whose threads outlive that fails the worker, as
    :func:`run_ranks` does, since such a thread can abort the process at exit.
    """
    import torch.distributed as dist

    import_group_capturing_modules()
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, **kwargs
    )
    try:
        yield
    except BaseException as exc:
        release_frames(exc)
        release_process_groups()
        raise
    alive = release_process_groups()
    if alive:
        raise AssertionError(f"process-group threads alive after release: {alive}")


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., dict], out: str, args: tuple
) -> None:
    torch.set_num_threads(1)
    _stderr_to(Path(out, STDERR_FILE.format(rank=rank)))
    try:
        with init_distributed("cpu", "gloo", rank_env(rank, world_size, port)) as ctx:
            result = fn(ctx, Path(out), *args)
            Path(out, RESULT_FILE.format(rank=rank)).write_text(json.dumps(result))
            del result
    except BaseException:
        Path(out, ERROR_FILE.format(rank=rank)).write_text(traceback.format_exc() + _leak_note())
        raise
    note = _leak_note()
    if note:
        Path(out, ERROR_FILE.format(rank=rank)).write_text(note)
        raise AssertionError(note)


def _stderr_to(path: Path) -> None:
    """Send this rank's fd 2 to ``path`` (appending) with the fault handler on, so that
    :func:`run_ranks` can report how a rank that died of a signal ended."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)


def _leak_note() -> str:
    """What is wrong if process-group threads outlived the context's close, else ''.

    close() joins the threads of every group nothing holds; one that survives it can abort
    the interpreter's exit, so a check (or a failure path) that leaks a group fails loudly.
    """
    alive = live_process_group_threads()
    return f"process-group threads alive after close: {alive}" if alive else ""


def start_ranks(
    fn: Callable[..., None], args: tuple, nprocs: int, *, join: bool = True
) -> mp.ProcessContext | None:
    """``torch.multiprocessing.spawn``, but each rank forked from the preloaded server
    (``tests/forkserver.py``).

    ``fn(rank, *args)`` must be importable by name, as for ``spawn``. The fork server keeps
    the environment it started with, so each rank is given this process's environment as it
    is at this call (as a spawned rank would inherit it).
    """
    forkserver.context()
    return mp.start_processes(
        _in_environment, (dict(os.environ), fn, args), nprocs, join=join, start_method="forkserver"
    )


def _in_environment(rank: int, env: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def run_ranks(
    world_size: int, fn: Callable[..., dict], out: Path, *args: Any, timeout_s: float = 900
) -> dict:
    """Run ``fn(ctx, out, *args)`` on ``world_size`` ranks; return rank 0's result dict.

    Ranks still running after ``timeout_s`` fail the call (after being killed): a rank that
    waits forever on a peer is a hang to report, not a test to wait for.
    """
    out.mkdir(parents=True, exist_ok=True)
    context = start_ranks(
        _worker, (world_size, free_port(), fn, str(out), args), world_size, join=False
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                break
    except Exception as exc:  # a rank raised or died: its traceback is in its error file
        raise AssertionError(_failure_report(out, exc)) from exc
    hung = [i for i, p in enumerate(context.processes) if p.is_alive()]
    if hung:
        for process in context.processes:
            process.kill()
            process.join()
        raise AssertionError(
            f"ranks {hung} of {world_size} were still running after {timeout_s:g} s "
            "(a rank waiting on a peer that will never answer?)"
        )
    return json.loads((out / RESULT_FILE.format(rank=0)).read_text())


def _failure_report(out: Path, exc: Exception, tail_lines: int = 60) -> str:
    """How the ranks failed, first line first: torch's verdict (which rank, which signal),
    then each rank's traceback, then the end of each non-empty standard error."""
    parts = [f"a rank failed ({exc}):"]
    parts += [p.read_text() for p in sorted(out.glob("error.rank*.txt"))]
    for path in sorted(out.glob("stderr.rank*.txt")):
        lines = path.read_text(errors="replace").splitlines()
        if lines:
            parts.append(f"--- end of {path.name} ---\n" + "\n".join(lines[-tail_lines:]))
    return "\n".join(parts)
