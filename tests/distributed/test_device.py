"""Device and backend resolution, process-group setup in one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from veoptim.distributed import (
    init_distributed,
    resolve_backend,
    resolve_device,
)
from veoptim.errors import ConfigError, DistributedError


def test_cpu_device_resolves_to_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_device_is_cuda_when_available_else_cpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_device_names_the_choices():
    with pytest.raises(
        ConfigError, match=r"run.device must be one of \['auto', 'cpu', 'cuda', 'npu'\]"
    ):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(DistributedError, match="torch.cuda.is_available"):
        resolve_device("cuda")


# One fresh interpreter answers both torch_npu questions (interpreter start dominates).
NPU_PROBE = """
import json, sys
from veoptim.distributed import init_distributed, resolve_device
from veoptim.errors import DistributedError
init_distributed("cpu", "auto", {})
imported_for_cpu = "torch_npu" in sys.modules
sys.modules["torch_npu"] = None  # as on a host without the optional package
try:
    resolve_device("npu")
    error = ""
except DistributedError as e:
    error = str(e)
print(json.dumps({"imported_for_cpu": imported_for_cpu, "npu_error": error}))
"""


@pytest.fixture(scope="module")
def npu_probe() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", NPU_PROBE], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_npu_is_not_imported_for_cpu_runs(npu_probe):
    assert npu_probe["imported_for_cpu"] is False


def test_npu_without_torch_npu_is_a_clear_error(npu_probe):
    assert npu_probe["npu_error"].startswith("run.device=npu needs the optional package torch_npu")


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")])
def test_auto_backend_follows_the_device(device, backend):
    assert resolve_backend("auto", device) == backend


def test_backend_that_cannot_run_on_the_device_is_rejected():
    with pytest.raises(ConfigError, match="parallel.backend=nccl does not run on device cpu"):
        resolve_backend("nccl", "cpu")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ConfigError, match="parallel.backend must be one of"):
        resolve_backend("mpi", "cpu")


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}])
def test_single_process_needs_no_process_group(env):
    ctx = init_distributed("cpu", "auto", env)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_main) == (0, 1, 0, True)
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
    assert not dist.is_initialized()
    ctx.close()  # a no-op without a group


def test_multi_process_env_without_master_addr_is_a_clear_error():
    with pytest.raises(DistributedError, match="MASTER_ADDR is required"):
        init_distributed("cpu", "gloo", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})


def test_malformed_world_size_is_a_clear_error():
    with pytest.raises(DistributedError, match="WORLD_SIZE must be an integer, got 'two'"):
        init_distributed("cpu", "gloo", {"WORLD_SIZE": "two"})
