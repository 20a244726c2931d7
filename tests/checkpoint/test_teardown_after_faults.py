"""Teardown after each injected checkpoint fault: one short 2-rank gloo spawn per scenario.

A job that survives a failed save or load must still end cleanly. ``destroy_process_group``
alone leaves a group's native threads running while anything holds the group (FSDP state,
DTensor's caches, an exception's frames), and a work thread still releasing a finished
collective when the interpreter exits aborts the process ("terminate called without an
active exception"). So after every close the spawn harness requires that no process-group
thread is left and every rank exits 0; here each fault scenario gets its own spawn, so a
regression names its scenario instead of failing a shared one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoint.ckpt_state import build_trainer, load_with, save_with
from tests.checkpoint.test_checkpoint_agreement import LOAD_FAULTS, SAVE_FAULTS, _attempt, _fault
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import step_name
from veoptim.checkpoint.checkpointer import Checkpointer

FSDP = ["parallel=fsdp", "parallel.param_dtype=fp32"]
SCENARIOS = [f"save:{p}" for p in SAVE_FAULTS] + [f"load:{p}" for p in LOAD_FAULTS]

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def _survive_one_fault(ctx, out: Path, scenario: str) -> dict:
    kind, phase = scenario.split(":", 1)
    failing = (SAVE_FAULTS if kind == "save" else LOAD_FAULTS)[phase]
    trainer = build_trainer(out / "run", FSDP, ctx)
    root = out / "ckpt"
    trainer.train_step()
    save_with(Checkpointer(root, fsync=False), trainer, step_name(1))
    trainer.train_step()
    faulty = Checkpointer(root, fsync=False, fault_hook=_fault(phase, failing))
    if kind == "save":
        error, _ = _attempt(lambda: save_with(faulty, trainer, step_name(2)))
    else:
        error, _ = _attempt(lambda: load_with(faulty, trainer, step_name(1)))
    if kind == "save" or phase in ("validate", "read"):
        trainer.train_step()  # the job goes on after the refused save or load
    return {"error": error}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_job_that_survived_the_fault_leaves_no_process_group_thread(tmp_path, scenario):
    # run_ranks raises if a rank aborted or exited non-zero, or if process-group threads
    # were still alive after its context closed.
    result = run_ranks(2, _survive_one_fault, tmp_path, scenario)
    assert result["error"] and "injected fault at" in result["error"]


def _fail_mid_run(ctx, out: Path) -> dict:
    trainer = build_trainer(out / "run", FSDP, ctx)
    trainer.train_step()
    raise RuntimeError(f"an error on rank {dist.get_rank()} with the trainer in this frame")


def test_a_job_that_fails_lets_go_of_its_groups_before_closing(tmp_path):
    # The error's traceback holds this frame and its trainer; the context clears such
    # frames on the way out, so the groups can still be destroyed.
    with pytest.raises(AssertionError) as failed:
        run_ranks(2, _fail_mid_run, tmp_path)
    assert "with the trainer in this frame" in str(failed.value)
    assert "process-group threads alive" not in str(failed.value)


_KEPT: list = []


def _keep_the_trainer(ctx, out: Path) -> dict:
    _KEPT.append(build_trainer(out / "run", FSDP, ctx))
    _KEPT[-1].train_step()
    return {}


def test_a_group_held_past_close_is_caught(tmp_path):
    # Negative control: a trainer kept alive past close() holds its groups and their threads.
    with pytest.raises(AssertionError, match="process-group threads alive after close"):
        run_ranks(2, _keep_the_trainer, tmp_path)
