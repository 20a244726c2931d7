"""SIGTERM mid-run: finish the step, agree, save, exit non-zero; resuming is bitwise.

Real ``python -m tasks.sft`` processes (one process, forked from the preloaded server of
``tests/forkserver.py``, and two ranks under torchrun with the signal sent to one rank
only), real signals, real checkpoints compared tensor by tensor with a straight run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.checkpoint.helpers import ckpt_io
from tests.conftest import REPO
from veoptim.checkpoint import latest_complete, step_name

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
COMMON = [
    "run.device=cpu",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "scheduler.warmup_steps=1",
    "logging.progress=false",
    "export.hf=false",
    "checkpoint.fsync=false",
]


def _command(nproc: int, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "tasks.sft", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={nproc}", "-m", "tasks.sft", *overrides]


def _run(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    if nproc == 1:
        done = forkserver.run_module("tasks.sft", overrides, cwd=REPO, env=ENV, timeout=600)
    else:
        done = subprocess.run(_command(nproc, overrides), cwd=REPO, env=ENV, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _logged_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return sorted(kids)


def _signal_mid_run(nproc: int, overrides: list[str], run_dir: Path) -> tuple[int, str]:
    """Start the run, SIGTERM one process (the last rank) once a few steps are logged."""
    log = run_dir.parent / f"{run_dir.name}.out"
    if nproc == 1:
        proc = forkserver.ForkedModule("tasks.sft", overrides, cwd=REPO, env=ENV, stdout=log)
    else:
        with log.open("w") as out:
            proc = subprocess.Popen(_command(nproc, overrides), cwd=REPO, env=ENV,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 300
    while _logged_steps(run_dir) < 3:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the run logged no steps"
        time.sleep(0.05)
    target = proc.pid if nproc == 1 else _children(proc.pid)[-1]
    os.kill(target, signal.SIGTERM)
    return proc.wait(timeout=300), log.read_text()


@pytest.mark.parametrize("nproc,steps", [(1, 100), (2, 60)], ids=["1proc", "2ranks"])
def test_sigterm_saves_and_a_resume_is_bitwise_the_straight_run(tmp_path, nproc, steps):
    parallel = [] if nproc == 1 else ["parallel=fsdp"]
    common = [*COMMON, *parallel, f"train.max_steps={steps}", "checkpoint.save_steps=0"]
    straight_dir, sliced_dir = tmp_path / "straight", tmp_path / "sliced"
    _run(nproc, [*common, f"run.dir={straight_dir}"])
    code, output = _signal_mid_run(nproc, [*common, f"run.dir={sliced_dir}"], sliced_dir)
    assert code != 0, output[-3000:]
    assert "checkpoint.resume=auto" in output and "SIGTERM" in output, output[-3000:]
    root = sliced_dir / "checkpoints"
    stopped = latest_complete(root)
    assert stopped is not None and stopped != step_name(steps), output[-3000:]
    stopped_step = int(stopped.split("_")[1])
    assert 3 <= stopped_step < steps
    assert _logged_steps(sliced_dir) == stopped_step  # every rank stopped after the same step
    _run(nproc, [*common, f"run.dir={sliced_dir}", "checkpoint.resume=auto"])
    final = ckpt_io.read_checkpoint(root / step_name(steps))
    reference = ckpt_io.read_checkpoint(straight_dir / "checkpoints" / step_name(steps))
    assert ckpt_io.differences(reference, final) == []
    assert ckpt_io.metrics(sliced_dir) == ckpt_io.metrics(straight_dir)


GUARD = """
import signal, sys, time
sys.path.insert(0, {repo!r})
from veoptim.trainer.preemption import PreemptionGuard
with PreemptionGuard() as guard:
    print("ready", flush=True)
    while not guard.requested:
        time.sleep(0.01)
    print("first signal noted", flush=True)
    while True:  # a long save: the second signal must not wait for it
        time.sleep(0.01)
"""


def test_a_second_signal_exits_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", GUARD.format(repo=str(REPO))], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "first signal noted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    assert "second SIGINT: exiting now" in err


def test_the_guard_restores_the_previous_handlers():
    from veoptim.trainer.preemption import PreemptionGuard

    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


#: case: (how the preempted run was started, what its message says to change: the overrides
#: to drop and to add, and what the command so changed restores)
HINTS = {
    "overwrite, weights-only saves": (
        ["checkpoint.overwrite=true", "checkpoint.save_optimizer=false"],
        ["checkpoint.overwrite=true"],
        ["checkpoint.resume=auto", "checkpoint.load_optimizer=false"],
        "restored model weights only",
    ),
    "a warm start from another run's weights": (
        ["checkpoint.resume={warm}", "checkpoint.load_optimizer=false"],
        ["checkpoint.resume={warm}"],
        ["checkpoint.resume=auto", "checkpoint.load_optimizer=true"],  # true after false wins
        "restored model, optimizer, lr_scheduler",
    ),
}


@pytest.mark.parametrize("case", list(HINTS))
def test_the_command_a_preempted_run_prints_resumes_it(tmp_path, case):
    """The message's changes to the command, made as written, give a command the next start
    accepts and that resumes the preempted run's own checkpoint. "The same command plus
    checkpoint.resume=auto" alone was refused for a run saving weights only (a whole resume
    of a weights-only checkpoint), and after a warm start it kept load_optimizer=false."""
    warm = tmp_path / "warm" / "checkpoints" / step_name(2)
    _run(1, [*COMMON, "train.max_steps=2", f"run.dir={tmp_path / 'warm'}"])
    started, dropped, added, restored = (
        [arg.format(warm=warm) for arg in args] if isinstance(args, list) else args
        for args in HINTS[case]
    )
    run_dir = tmp_path / "run"
    command = [*COMMON, "train.max_steps=100", "checkpoint.save_steps=0", f"run.dir={run_dir}",
               *started]  # fmt: skip
    code, output = _signal_mid_run(1, command, run_dir)
    said = f"Continue with the same command without {' '.join(dropped)}, plus {' '.join(added)}"
    assert code != 0 and said in output, output[-3000:]
    stopped = latest_complete(run_dir / "checkpoints")
    followed = _run(1, [arg for arg in command if arg not in dropped] + added)
    log = followed.stdout + followed.stderr
    assert restored in log and f"(step {int(stopped.split('_')[1])})" in log, log[-3000:]
    assert str(run_dir / "checkpoints" / ".versions" / stopped) in log, log[-3000:]
    assert latest_complete(run_dir / "checkpoints") == step_name(100)
