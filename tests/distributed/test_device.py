"""Device and backend resolution, the host's Accelerator, process-group setup in one process.

The npu path runs against a fake torch_npu in interpreters of its own:
``test_npu_path.py``.
"""

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
from veoptim.distributed.device import accelerator, device_module
from veoptim.errors import ConfigError, DistributedError

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("backend", ["hccl", "gloo"])
def test_npu_takes_hccl_or_gloo(backend):
    assert resolve_backend(backend, "npu") == backend


@pytest.mark.parametrize(
    "backend,device,advice",
    [("nccl", "npu", "'hccl'"), ("hccl", "cuda", "'nccl'"), ("hccl", "cpu", "'gloo'")],
)
def test_collective_backend_of_another_device_is_refused(backend, device, advice):
    with pytest.raises(
        ConfigError,
        match=f"parallel.backend={backend} does not run on device {device}; use {advice}",
    ):
        resolve_backend(backend, device)


def test_host_accelerator_is_plain_memory_synchronous_copies_and_no_events():
    accel = accelerator(torch.device("cpu"))
    assert accel == accelerator("cpu") and accel.is_host and accel.module is None
    buf = accel.host_buffer(8)
    assert buf.dtype == torch.uint8 and buf.numel() == 8 and not buf.is_pinned()
    accel.copy_(buf, torch.arange(8, dtype=torch.uint8))
    assert buf.tolist() == list(range(8))
    assert accel.record_event(torch.device("cpu")) is None
    cpu_rng = torch.get_rng_state()
    assert accel.get_rng_state(torch.device("cpu")) is None
    accel.set_rng_state(torch.zeros(16, dtype=torch.uint8), torch.device("cpu"))
    accel.synchronize(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), cpu_rng), "torch's CPU generator is not touched"


def test_cuda_goes_through_torch_cuda():
    assert accelerator(torch.device("cuda", 0)).module is torch.cuda
    assert device_module("cuda") is torch.cuda


@pytest.mark.parametrize("device_type", ["cpu", "mps", "meta"])
def test_only_cuda_and_npu_have_a_device_module(device_type):
    with pytest.raises(DistributedError, match=f"no device module for device type '{device_type}'"):
        device_module(device_type)


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
