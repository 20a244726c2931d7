"""Every writer of a run dir takes its lock: a training task, a multi-LoRA run, the
training service, an export published into it, and a torchrun job (rank 0 holds the lock,
every rank gets the same refusal). Real commands against a real holder process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_task_cli
from tests.rundir.holder import hold, stop
from veoptim.rundir import LOCK_FILE, RunIdentity, write_identity

pytestmark = pytest.mark.slow

TINY = ["run.device=cpu", "logging.progress=false", "train.max_steps=2"]


@pytest.fixture
def held(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_identity(run_dir, RunIdentity.fresh())
    holder = hold(run_dir)
    yield run_dir, holder
    stop(holder)


def refusal(done: subprocess.CompletedProcess, holder: subprocess.Popen) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    lines = [line for line in output.splitlines() if "is in use by" in line]
    assert len(lines) == 1 and f"pid {holder.pid} on " in lines[0], output[-3000:]
    return lines[0]


@pytest.mark.parametrize("task", ["sft", "multi_lora", "serve"])  # dpo: sft's runner
def test_every_task_refuses_a_run_dir_in_use(held, task: str) -> None:
    run_dir, holder = held
    refusal(run_task_cli(task, [f"run.dir={run_dir}", "run.device=cpu"], REPO), holder)


def test_an_export_into_a_run_dir_in_use_is_refused(held, tmp_path: Path) -> None:
    run_dir, holder = held
    source = tmp_path / "source"
    done = run_task_cli("sft", [*TINY, f"run.dir={source}", "export.hf=false"], REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    args = [str(source / "checkpoints" / "step_00000002"), "--out", str(run_dir / "exports"),
            "--name", "hf_2"]  # fmt: skip
    command = [sys.executable, "-m", "tasks.export", *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "this export another run.dir" in refusal(done, holder)
    assert not (run_dir / "exports" / "hf_2").exists()
    # Outside any run dir, nothing is locked.
    command[-3] = str(tmp_path / "elsewhere")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_under_torchrun_every_rank_gets_the_same_refusal(held) -> None:
    run_dir, holder = held
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "tasks.sft", *TINY, "parallel=fsdp",
               f"run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    lines = [line for line in output.splitlines() if "is in use by" in line]
    assert {line.split("]", 1)[0] for line in lines} >= {"[rank0", "[rank1"}, output[-4000:]
    assert len({line.split("RunDirInUseError: ", 1)[-1] for line in lines}) == 1
    assert str(holder.pid) in (run_dir / LOCK_FILE).read_text()  # the holder's, untouched
