"""Light submodules stay light: the package ``__init__`` imports its heavy parts lazily.

Checkpoint crash and reader subprocesses import ``veoptim.distributed.agreement``
many times; pulling in torch, FSDP or DTensor there would cost seconds per process.
A task command answers ``--help`` or a mistyped key before torch loads (in about a
second instead of six). Each check runs in a fresh interpreter, since this one has long
imported torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

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
    [
        "import veoptim.distributed.agreement",
        "import veoptim.distributed",
        "import veoptim.arith",
        # the versioned store (crash writers and readers): the door's torch names are lazy
        "import veoptim.checkpoint, veoptim.checkpoint.publish, veoptim.checkpoint.versions",
    ],
)
def test_import_pulls_in_no_torch(statement: str) -> None:
    assert _imported_after(statement) == []


def _task_command(task: str, *args: str) -> str:
    """Run ``python -m tasks.<task> args`` in this interpreter up to its exit."""
    return (
        "import contextlib, io, runpy\n"
        f"sys.argv = ['{task}', *{list(args)!r}]\n"
        "out = io.StringIO()\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out), "
        "contextlib.redirect_stderr(out):\n"
        f"    runpy.run_module('tasks.{task}', run_name='__main__')\n"
        "assert out.getvalue(), 'the command printed nothing'"
    )


@pytest.mark.parametrize(
    "statement",
    [
        "import tasks.sft, tasks.dpo, veoptim.objectives, veoptim.trainer",
        _task_command("sft", "--help"),
        _task_command("sft", "optim.lrr=1e-3"),
        _task_command("sft", "model.dtype=fp16"),
        _task_command("dpo", "train.max_step=5"),
        "import tasks.serve, veoptim.slots, veoptim.service",
        _task_command("serve", "serve.portt=1"),
    ],
    ids=[
        "import",
        "help",
        "unknown-key",
        "bad-value",
        "dpo-unknown-key",
        "import-serve",
        "serve-unknown-key",
    ],  # fmt: skip
)
def test_a_task_command_answers_help_and_mistakes_without_torch(statement: str) -> None:
    assert _imported_after(statement) == []


def test_the_keys_command_adds_a_tenant_without_torch(tmp_path) -> None:
    statement = _task_command("serve", "keys", "add", "alice", f"run.dir={tmp_path}")
    assert _imported_after(statement) == []
    assert (tmp_path / "service.sqlite").is_file()


def test_a_valid_task_command_goes_on_to_load_torch(tmp_path) -> None:
    # the negative control: the same harness sees torch once the command gets past its checks
    statement = _task_command("sft", "run.dry_run=true", f"run.dir={tmp_path}")
    assert "torch" in _imported_after(statement)


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
