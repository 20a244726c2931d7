"""Process-group setup from the launcher's environment (torchrun), passed in explicitly.

The caller (a task) passes ``os.environ``; library code never reads the
environment itself. One process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) needs no
process group, and everything downstream works without one.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

from veoptim.distributed.device import local_device, resolve_backend, resolve_device
from veoptim.errors import DistributedError

ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
# torchrun's agent hosts the TCPStore itself; workers must then connect as clients only.
ENV_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
DEFAULT_TIMEOUT = timedelta(minutes=30)
#: Names of the native threads a gloo process group runs (its work loop and its transport's
#: event loop); they stop only when the group's last Python reference is gone.
PROCESS_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")

log = logging.getLogger(__name__)


def live_process_group_threads() -> list[str]:
    """Names of this process's live process-group threads (empty where /proc is missing)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name in PROCESS_GROUP_THREADS:
            names.append(name)
    return sorted(names)


def release_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames that ``error`` (and its causes) passed through.

    A propagating exception keeps every frame it left alive, and with them the trainer, its
    model and the process groups they hold, until the exception is gone, which for the
    one that ends a job is at interpreter exit: too late for :meth:`DistContext.close`.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def release_process_groups() -> list[str]:
    """Destroy every process group and stop their native threads; the threads still alive.

    ``destroy_process_group`` only unregisters the groups: a group's native threads stop
    when its last Python reference goes, and FSDP states, device meshes and exception
    tracebacks hold groups in reference cycles that only the garbage collector frees. A
    group left for the interpreter's exit can abort the process ("terminate called
    without an active exception"): its work thread, still releasing a finished
    collective, needs the GIL while the interpreter shuts down. So the groups are
    destroyed, torch's caches that hold them emptied and garbage collected, which joins
    the threads of every group nothing holds any more. Whoever initialised the default
    group ends with this call, not with a bare ``destroy_process_group``.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_torch_distributed_caches()
    gc.collect()
    return live_process_group_threads()


@dataclass
class DistContext:
    """Who this process is in the job, and on which device it computes."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_process_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that logs, writes run-level files and shows progress."""
        return self.rank == 0

    def close(self) -> None:
        """Release the process groups if this context created them (see
        :func:`release_process_groups`), and warn if some group's threads outlive that: an
        object still holds it. Idempotent."""
        if not self.owns_process_group:
            return
        self.owns_process_group = False
        alive = release_process_groups()
        if alive:
            log.warning(
                "%d process-group threads are still running after the process group was "
                "destroyed: an object still holds a group (a trainer or model kept alive "
                "past close()); drop it first, or the process may abort at exit.",
                len(alive),
            )

    def __enter__(self) -> DistContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close on the way out; a propagating error first lets go of what its frames hold."""
        release_frames(exc)
        self.close()


def _int_env(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise DistributedError(
                f"environment variable {key} is required under a multi-process launch but unset."
            )
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise DistributedError(
            f"environment variable {key} must be an integer, got {raw!r}."
        ) from exc


def _create_store(
    env: Mapping[str, str], rank: int, world_size: int, timeout: timedelta
) -> dist.Store:
    """The rendezvous store, as torch's ``env://`` would build it, but from ``env``."""
    addr = env.get(ENV_MASTER_ADDR)
    if not addr:
        raise DistributedError(
            f"environment variable {ENV_MASTER_ADDR} is required when WORLD_SIZE > 1; launch with torchrun."
        )
    port = _int_env(env, ENV_MASTER_PORT)
    use_agent_store = env.get(ENV_USE_AGENT_STORE, "").lower() == "true"
    if use_agent_store:
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    return dist.TCPStore(
        addr, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
    )


def _clear_torch_distributed_caches() -> None:
    """Empty the memo caches of torch.distributed: process-wide, DTensor's sharding
    propagation (in Python and in its C++ fast path), its redistribution plans and planners and
    its mesh topologies keep every spec they saw, and with them the device meshes and process
    groups of the run. Dropping a cache costs a recomputation, never a result."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()  # its planners hold their meshes, not weakly
    with warnings.catch_warnings():  # isinstance on torch's deprecated-name proxies warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, LocalLRUCache) or (
                isinstance(obj, functools._lru_cache_wrapper)
                and str(getattr(obj, "__module__", "")).startswith("torch.distributed")
            ):
                obj.cache_clear()


def import_group_capturing_modules() -> None:
    """Import, before the default group exists, the torch modules whose function defaults
    are ``group.WORLD``: imported after, they hold the default group for good and
    :func:`release_process_groups` could never stop its threads."""
    import torch.distributed.fsdp  # noqa: F401  (nn.functional's collectives, the grad scaler)
    import torch.distributed.optim  # noqa: F401  (ZeroRedundancyOptimizer)


def init_distributed(
    device: str, backend: str, env: Mapping[str, str], timeout: timedelta = DEFAULT_TIMEOUT
) -> DistContext:
    """Resolve the device and, under a multi-process launcher, join the default process group.

    ``device`` is ``run.device`` (auto|cpu|cuda|npu), ``backend`` is
    ``parallel.backend`` (auto|gloo|nccl|hccl), ``env`` the launcher's environment.
    """
    device_type = resolve_device(device)
    backend_name = resolve_backend(backend, device_type.type)
    world_size = _int_env(env, ENV_WORLD_SIZE, default=1)
    if world_size < 1:
        raise DistributedError(f"{ENV_WORLD_SIZE} must be >= 1, got {world_size}.")
    if world_size == 1:
        local = local_device(device_type, _int_env(env, ENV_LOCAL_RANK, default=0))
        return DistContext(rank=0, world_size=1, local_rank=0, device=local, backend=backend_name)
    rank = _int_env(env, ENV_RANK)
    local_rank = _int_env(env, ENV_LOCAL_RANK)
    if not 0 <= rank < world_size:
        raise DistributedError(f"{ENV_RANK}={rank} is outside [0, {ENV_WORLD_SIZE}={world_size}).")
    local = local_device(device_type, local_rank)
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedError(
                f"a default process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"but the environment says rank {rank}/{world_size}."
            )
        return DistContext(
            rank, world_size, local_rank, local, backend_name, owns_process_group=False
        )
    import_group_capturing_modules()
    store = _create_store(env, rank, world_size, timeout)
    dist.init_process_group(
        backend=backend_name,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=local if local.type != "cpu" else None,
    )
    return DistContext(rank, world_size, local_rank, local, backend_name, owns_process_group=True)
