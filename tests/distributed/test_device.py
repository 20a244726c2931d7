"""Device and backend resolution, process-group setup in one process, rank-aware logging."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from veoptim.distributed import (
    DistContext,
    init_distributed,
    resolve_backend,
    resolve_device,
    setup_logging,
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


def test_npu_without_torch_npu_is_a_clear_error():
    code = (
        "import sys\n"
        "sys.modules['torch_npu'] = None  # as on a host without the optional package\n"
        "from veoptim.distributed import resolve_device\n"
        "from veoptim.errors import DistributedError\n"
        "try:\n    resolve_device('npu')\nexcept DistributedError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("OK run.device=npu needs the optional package torch_npu")


def test_torch_npu_is_not_imported_for_cpu_runs():
    code = (
        "import sys\nfrom veoptim.distributed import init_distributed\n"
        "init_distributed('cpu', 'auto', {})\nprint('torch_npu' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


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


def _rank_logging_output(rank: int, world_size: int, capsys) -> str:
    ctx = DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        device=torch.device("cpu"),
        backend="gloo",
    )
    root = logging.getLogger()
    saved_level = root.level
    try:
        setup_logging(ctx, "INFO")
        setup_logging(ctx, "INFO")  # idempotent: still one handler
        log = logging.getLogger("veoptim.test")
        log.info("info line")
        log.warning("warning line")
        return capsys.readouterr().err
    finally:
        for h in [h for h in root.handlers if h.get_name() == "veoptim-rank-aware"]:
            root.removeHandler(h)
        root.setLevel(saved_level)


def test_rank_zero_logs_at_the_configured_level_with_rank_prefix(capsys):
    err = _rank_logging_output(0, 2, capsys)
    assert err.count("info line") == 1 and "[rank0]" in err


def test_other_ranks_log_warnings_only(capsys):
    err = _rank_logging_output(1, 2, capsys)
    assert "info line" not in err and "[rank1]" in err and "warning line" in err


def test_single_process_logs_have_no_rank_prefix(capsys):
    err = _rank_logging_output(0, 1, capsys)
    assert "info line" in err and "[rank" not in err


def test_unknown_log_level_is_rejected():
    ctx = DistContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )
    with pytest.raises(ConfigError, match="logging.level"):
        setup_logging(ctx, "LOUD")
