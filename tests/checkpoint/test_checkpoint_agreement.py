"""Cross-rank agreement of training checkpoints, on 2 real FSDP2 gloo ranks.

A fault injected on one rank in any phase (gather, writer, write, publish; validate,
read, apply, and apply after the first live write)
makes every rank raise the same CheckpointError naming that rank, promptly; a failed
save leaves the previous checkpoint published, a failed validate/read leaves the live
run bitwise unchanged on every rank. All scenarios share one spawn.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import latest_complete, step_name
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.faults import LOAD_PHASES, SAVE_PHASES
from veoptim.errors import CheckpointError

pytestmark = pytest.mark.slow

#: phase -> the rank that fails there. gather/writer run before DCP's own collectives: a
#: failure there must not leave the other rank waiting inside dcp.save.
SAVE_FAULTS = {"gather": 1, "writer": 1, "write": 1, "before_manifest": 0, "before_replace": 0}
LOAD_FAULTS = {"validate": 1, "read": 1, "apply": 1, "apply:model": 1}
UNCHANGED_AFTER = ("validate", "read")


def _fault(phase: str, on_rank: int):
    def hook(current: str) -> None:
        if current == phase and dist.get_rank() == on_rank:
            raise OSError(5, f"injected fault at {phase}")

    return hook


def _attempt(fn) -> tuple[str | None, float]:
    start = time.monotonic()
    try:
        fn()
    except CheckpointError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def _scenarios(ctx, out: Path) -> dict:
    trainer = build_trainer(out / "run", ["parallel=fsdp", "parallel.param_dtype=fp32"], ctx)
    root = out / "ckpt"
    trainer.train_step()
    save_with(Checkpointer(root, fsync=False), trainer, step_name(1))
    trainer.train_step()
    results: dict[str, dict] = {}
    for phase, rank in SAVE_FAULTS.items():
        saver = Checkpointer(root, fsync=False, fault_hook=_fault(phase, rank))
        error, seconds = _attempt(lambda s=saver: save_with(s, trainer, step_name(2)))
        results[f"save:{phase}"] = {"error": error, "seconds": seconds,
                                    "latest": latest_complete(root)}  # fmt: skip
    for phase, rank in LOAD_FAULTS.items():
        before = snapshot(trainer)
        loader = Checkpointer(root, fsync=False, fault_hook=_fault(phase, rank))
        error, seconds = _attempt(lambda ld=loader: load_with(ld, trainer, step_name(1)))
        try:
            assert_bitwise_equal(before, snapshot(trainer))
            unchanged = True
        except AssertionError:
            unchanged = False
        results[f"load:{phase}"] = {"error": error, "seconds": seconds, "unchanged": unchanged}
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, results)
    return {"ranks": gathered}


@functools.cache
def _results(tmp_root: str) -> list[dict]:
    return run_ranks(2, _scenarios, Path(tmp_root), timeout_s=120)[
        "ranks"
    ]  # ~12 s: a hang fails fast


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("agreement")))


@pytest.mark.parametrize(
    "scenario", [f"save:{p}" for p in SAVE_FAULTS] + [f"load:{p}" for p in LOAD_FAULTS]
)
def test_fault_on_one_rank_raises_the_same_error_on_every_rank(ranks, scenario):
    phase = scenario.split(":", 1)[1]
    failing = SAVE_FAULTS.get(phase, LOAD_FAULTS.get(phase))
    errors = [r[scenario]["error"] for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert f"rank {failing}" in errors[0] and f"injected fault at {phase}" in errors[0]
    assert max(r[scenario]["seconds"] for r in ranks) < 60


@pytest.mark.parametrize("phase", list(SAVE_FAULTS))
def test_failed_save_keeps_the_previous_checkpoint_published(ranks, phase):
    assert all(r[f"save:{phase}"]["latest"] == step_name(1) for r in ranks)


@pytest.mark.parametrize("phase", ["apply", "apply:model"])
def test_failed_apply_says_the_live_state_is_invalid_on_every_rank(ranks, phase):
    assert all("is not valid: this run must stop" in r[f"load:{phase}"]["error"] for r in ranks)


@pytest.mark.parametrize("phase", UNCHANGED_AFTER)
def test_failed_load_leaves_live_state_unchanged_on_every_rank(ranks, phase):
    assert all(r[f"load:{phase}"]["unchanged"] for r in ranks)


def test_the_fault_scenarios_name_the_checkpointers_phases():
    """Every phase a load fires is injected, and every injected phase is a named one."""
    assert set(SAVE_FAULTS) <= set(SAVE_PHASES)
    assert {phase.split(":")[0] for phase in LOAD_FAULTS} == set(LOAD_PHASES)
