"""Spawn worker of ``test_raw_storage_multirank.py``: DTensor shards through the raw layout.

Two gloo ranks save DTensors sharded on dim 0 (uneven), on dim 1, replicated, and a plain
tensor with veoptim's ``RawFileSystemWriter``, then load them through
``SafeFileSystemReader`` into the *other* sharding (dim 1 <-> dim 0), which makes DCP
request partial boxes of the saved chunks (contiguous row ranges and strided column
ranges). Each rank writes whether every loaded tensor equals the original.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

WORLD = 2


def full_tensors() -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(5, 6, generator=generator).to(torch.bfloat16),
        "cols": torch.randn(4, 7, generator=generator),
        "replicated": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "plain": torch.tensor(1.5, dtype=torch.float64),
    }


def worker(rank: int, init_file: str, ckpt: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from tests.distributed.spawn import own_process_group

    timeout = datetime.timedelta(seconds=60)
    with own_process_group(rank, WORLD, f"file://{init_file}", timeout=timeout):
        _save_and_reshard(rank, ckpt, out_dir)


def _save_and_reshard(rank: int, ckpt: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from veoptim.checkpoint.storage.raw_writer import RawFileSystemWriter
    from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader

    mesh = init_device_mesh("cpu", (WORLD,))
    full = full_tensors()

    def state(rows: int, cols: int) -> dict:
        return {
            "rows": distribute_tensor(full["rows"], mesh, [Shard(rows)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(cols)]),
            "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
            "plain": full["plain"].clone(),
        }

    dcp.save(state(0, 1), storage_writer=RawFileSystemWriter(ckpt, thread_count=2))
    target = state(1, 0)
    for value in target.values():
        local = value.to_local() if hasattr(value, "to_local") else value
        local.zero_()
    dcp.load(target, storage_reader=SafeFileSystemReader(ckpt))
    equal = {}
    for key, value in target.items():
        loaded = value.full_tensor() if hasattr(value, "full_tensor") else value
        equal[key] = bool(torch.equal(loaded, full[key]) and loaded.dtype == full[key].dtype)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(equal))
    dist.barrier()
