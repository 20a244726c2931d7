"""Run a function on N gloo ranks (torch.multiprocessing.spawn) and collect rank 0's JSON result.

Process start dominates multi-rank tests, so each spawn runs a whole batch of
checks and returns their measurements; the test functions then assert on them.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from veoptim.distributed import DistContext, init_distributed

RESULT_FILE = "result.rank{rank}.json"
ERROR_FILE = "error.rank{rank}.txt"


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


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., dict], out: str, args: tuple
) -> None:
    torch.set_num_threads(1)
    ctx: DistContext | None = None
    try:
        ctx = init_distributed("cpu", "gloo", rank_env(rank, world_size, port))
        result = fn(ctx, Path(out), *args)
        Path(out, RESULT_FILE.format(rank=rank)).write_text(json.dumps(result))
    except BaseException:
        Path(out, ERROR_FILE.format(rank=rank)).write_text(traceback.format_exc())
        raise
    finally:
        if ctx is not None:
            ctx.close()


def run_ranks(world_size: int, fn: Callable[..., dict], out: Path, *args: Any) -> dict:
    """Run ``fn(ctx, out, *args)`` on ``world_size`` ranks; return rank 0's result dict."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(
            _worker,
            args=(world_size, free_port(), fn, str(out), args),
            nprocs=world_size,
            join=True,
        )
    except Exception as exc:
        errors = [p.read_text() for p in sorted(out.glob("error.rank*.txt"))]
        raise AssertionError("a rank failed:\n" + "\n".join(errors)) from exc
    return json.loads((out / RESULT_FILE.format(rank=0)).read_text())
