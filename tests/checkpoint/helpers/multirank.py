"""One 2-rank gloo spawn that runs every multi-rank agreement and publication scenario.

Process start dominates (torch import per rank), so all scenarios share one spawn; each
rank records what it observed in ``rank<r>.json`` and the tests assert on that. The spawn
runs once per pytest process (``results`` is cached).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD = 2
TIMEOUT_S = 60


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; record its error message (None on success) and how long it took."""
    from veoptim.errors import CheckpointError

    start = time.monotonic()
    try:
        value = fn()
        error = None
    except CheckpointError as exc:
        value, error = None, str(exc)
    return {"error": error, "value": value, "seconds": time.monotonic() - start}


def _save(pub: Any, step: int, *, fail_rank: int | None = None) -> str:
    import torch.distributed as dist

    from tests.checkpoint.helpers.payload import write_payload

    rank = dist.get_rank()
    with pub.write("ckpt", step=step) as version:
        if rank == 0:
            write_payload(version, step, 1000)
        (version / f"rank{rank}.bin").write_bytes(bytes([rank]) * 100)
        if rank == fail_rank:
            raise OSError(28, "No space left on device", str(version / f"rank{rank}.bin"))
    return str(version)


def _hook(phase: str, on_rank: int) -> Callable[[str], None]:
    import torch.distributed as dist

    def hook(current: str) -> None:
        if current == phase and dist.get_rank() == on_rank:
            raise OSError(5, f"injected fault at {phase}")

    return hook


def worker(rank: int, init_file: str, root: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.spawn import own_process_group

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    with own_process_group(rank, WORLD, f"file://{init_file}", timeout=timeout):
        _scenarios(rank, root, out_dir)


def _scenarios(rank: int, root: str, out_dir: str) -> None:
    import torch.distributed as dist

    from veoptim.checkpoint.layout import published_names
    from veoptim.checkpoint.publish import Publisher
    from veoptim.checkpoint.versions import resolve, resolve_agreed
    from veoptim.distributed.agreement import agree

    root_path = Path(root)
    res: dict[str, Any] = {}

    def rank_fails(which: set[int], delay_ok: float = 0.0) -> Callable[[], None]:
        def run() -> None:
            if rank in which:
                agree(ValueError(f"boom on {rank}"), "test phase")
            else:
                time.sleep(delay_ok)
                agree(True, "test phase")

        return run

    res["agree_ok"] = _outcome(rank_fails(set()))
    res["agree_one"] = _outcome(rank_fails({1}))
    res["agree_both"] = _outcome(rank_fails({0, 1}))
    res["agree_slow_peer"] = _outcome(rank_fails({0}, delay_ok=1.0))
    sub = dist.new_group([0, 1])
    res["agree_subgroup"] = _outcome(
        lambda: agree(True if rank == 0 else KeyError("k"), "subgroup phase", sub)
    )

    res["first"] = _outcome(lambda: _save(Publisher(root_path), 1))
    published = str(resolve(root_path, "ckpt")) if rank == 0 else None

    def state() -> dict[str, Any]:
        dist.barrier()  # the scenario is over on every rank...
        versions = sorted(os.listdir(root_path / ".versions"))
        seen = {"resolved": str(resolve(root_path, "ckpt")), "versions": versions}
        dist.barrier()  # ...and no rank starts the next one before all have looked
        return seen

    res["first_state"] = state()
    res["fail_write"] = _outcome(lambda: _save(Publisher(root_path), 2, fail_rank=1))
    res["fail_write_state"] = state()
    for phase, on_rank in (("prepared", 1), ("written", 1), ("before_replace", 0)):
        pub = Publisher(root_path, fault_hook=_hook(phase, on_rank))
        res[f"fail_{phase}"] = _outcome(lambda pub=pub: _save(pub, 2))
        res[f"fail_{phase}_state"] = state()

    def split_finish() -> str:  # the begin/finish API used for async saves
        pending = Publisher(root_path).begin("ckpt", step=2)
        pending.finish(RuntimeError("async write failed") if rank == 1 else None)
        return str(pending.path)

    res["fail_async"] = _outcome(split_finish)
    res["fail_async_state"] = state()
    res["second"] = _outcome(lambda: _save(Publisher(root_path, keep_last=1), 3))
    res["second_state"] = state()
    res["names"] = sorted(published_names(root_path))
    res["agreed_auto"] = str(resolve_agreed(root_path, "auto").path)
    res["agreed_missing"] = _outcome(lambda: resolve_agreed(root_path, "nope"))
    res["published_first"] = published
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@functools.cache
def results() -> dict[int, dict[str, Any]]:
    """Run the spawn once; rank -> what that rank observed."""
    from tests.distributed.spawn import start_ranks

    base = Path(tempfile.mkdtemp(prefix="veoptim-multirank-"))
    root, out = base / "ckpts", base / "out"
    out.mkdir()
    start_ranks(worker, (str(base / "init"), str(root), str(out)), WORLD)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}
