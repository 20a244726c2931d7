"""Light submodules stay light: the package ``__init__`` imports its heavy parts lazily.

Checkpoint crash and reader subprocesses import ``veoptim.distributed.agreement``
many times; pulling in torch, FSDP or DTensor there would cost seconds per process.
Each check runs in a fresh interpreter, since this one has long imported torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "torch.distributed.fsdp", "torch.distributed.tensor", "veoptim.distributed.plan")


def _imported_after(statement: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has in sys.modules after ``statement``."""
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize(
    "statement",
    ["import veoptim.distributed.agreement", "import veoptim.distributed", "import veoptim.arith"],
)
def test_import_pulls_in_no_torch(statement: str) -> None:
    assert _imported_after(statement) == []


def test_package_names_still_import_on_first_use() -> None:
    names = (
        "DistContext, LAYOUT_FORMAT_VERSION, LayoutMetadata, MESH_DIM_NAMES, ParallelPlan, "
        "ParallelSizes, build_parallel_plan, init_distributed, resolve_backend, resolve_device, "
        "resolve_parallel_sizes, setup_logging"
    )
    loaded = _imported_after(f"from veoptim.distributed import {names}")
    assert "torch.distributed.fsdp" in loaded and "veoptim.distributed.plan" in loaded


def test_unknown_name_is_an_attribute_error() -> None:
    import veoptim.distributed as dist_pkg

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = dist_pkg.no_such_name
