"""``checkpoint.async_save=true`` (one process and 2 gloo ranks): real trainer runs.

One spawn per world size runs a sync reference, a gated async run (the DCP data
write is held on its background thread until training finished the next step),
two runs whose async write fails on the last rank, and a run whose training fails
with a save in flight (see ``helpers/async_worker.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint.helpers import ckpt_io
from tests.checkpoint.helpers.async_worker import MAX_STEPS, SAVE_STEPS, run
from tests.distributed.spawn import RESULT_FILE, run_ranks
from veoptim.checkpoint import step_name

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

WORLDS = {
    "1proc": (1, ["model=tiny_dense", "parallel=single", "optim=full_fp32_adamw", "model.dtype=bf16"]),
    "2ranks": (2, ["model=tiny_dense", "parallel=fsdp", "optim=master_fp32_adamw", "model.dtype=bf16"]),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(WORLDS))
def outcome(request, tmp_path_factory) -> tuple[Path, list[dict]]:
    world, overrides = WORLDS[request.param]
    out = tmp_path_factory.mktemp(f"async_{request.param}")
    run_ranks(world, run, out, overrides)
    ranks = [json.loads((out / RESULT_FILE.format(rank=r)).read_text()) for r in range(world)]
    return out, ranks


def test_training_continues_while_the_async_save_runs(outcome):
    _, ranks = outcome
    for result in ranks:
        seen = result["async"]
        # step 3 finished while the step-2 save was still being written, off the main thread
        assert seen["step"] == SAVE_STEPS + 1 and seen["in_flight"] and seen["future_done"] is False
        assert seen["held"] and not seen["timed_out"], seen
        assert seen["thread"] != "MainThread"


@pytest.mark.parametrize("step", [SAVE_STEPS, MAX_STEPS])
def test_async_checkpoint_equals_sync_checkpoint_of_the_same_step(outcome, step):
    out, _ = outcome
    sync = ckpt_io.read_checkpoint(out / "sync" / "checkpoints" / step_name(step))
    async_ = ckpt_io.read_checkpoint(out / "async" / "checkpoints" / step_name(step))
    assert ckpt_io.master_keys(sync)
    assert ckpt_io.differences(sync, async_) == []
    assert ckpt_io.metrics(out / "sync") == ckpt_io.metrics(out / "async")


def test_async_failure_surfaces_at_the_next_save_on_every_rank(outcome):
    _, ranks = outcome
    errors = {r["fail_next_save"]["error"] for r in ranks}
    assert len(errors) == 1 and None not in errors, errors
    (error,) = errors
    assert "No space left on device (injected)" in error and "step_00000002" in error
    for result in ranks:
        case = result["fail_next_save"]
        assert case["raised_at_step"] == SAVE_STEPS + 1  # training went on; the next save raised
        assert case["latest"] == step_name(1)  # the previous checkpoint stays published


def test_async_failure_surfaces_at_train_end_on_every_rank(outcome):
    _, ranks = outcome
    errors = {r["fail_train_end"]["error"] for r in ranks}
    assert len(errors) == 1 and None not in errors, errors
    assert "No space left on device (injected)" in errors.pop()
    for result in ranks:
        case = result["fail_train_end"]
        assert case["raised_at_step"] == 3
        assert case["latest"] is None


def test_failed_training_abandons_the_in_flight_async_save(outcome):
    _, ranks = outcome
    for result in ranks:
        case = result["abandon"]
        assert case["raised"] and "blew up" in case["raised"]
        assert case["latest"] is None and not case["step_2_exists"]
        # The next run saves normally and removes the abandoned version directory.
        assert case["latest_after"] == step_name(1)
        assert case["versions_after"] == [step_name(1)]
