"""Process-group setup from the launcher's environment (torchrun), passed in explicitly.

The caller (a task) passes ``os.environ``; library code never reads the
environment itself. One process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) needs no
process group, and everything downstream works without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

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
        """Destroy the default process group if this context created it (idempotent)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


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
