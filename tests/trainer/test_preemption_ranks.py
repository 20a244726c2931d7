"""A stop signal one rank receives stops every rank after the same step (2 gloo ranks).

Only rank 1 gets a real SIGTERM (raised in its own process at the start of step 2); each
rank records, after every step, whether the trainer decided to stop. The test's callback
then ends the loop on every rank after step 2 whatever the trainer decided, so a rank
that missed the stop cannot wait forever in the next step's collectives: a flag that is
not combined across ranks fails the assertions in seconds instead of hanging the test.
The end-to-end run under torchrun (save, resume bitwise) is in ``test_preemption.py``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tasks.compose import load_config
from tests.distributed.spawn import RESULT_FILE, run_ranks
from veoptim.distributed import DistContext
from veoptim.errors import PreemptedError
from veoptim.trainer import Callback, Trainer

pytestmark = pytest.mark.slow

SIGNALLED_RANK, SIGNALLED_STEP = 1, 2
OVERRIDES = ["run.device=cpu", "parallel=fsdp", "train.global_batch_size=4",
             "train.micro_batch_size=1", "train.max_steps=5", "scheduler.warmup_steps=1",
             "logging.progress=false", "logging.level=WARNING", "export.hf=false",
             "checkpoint.fsync=false"]  # fmt: skip


class SignalOneRank(Callback):
    """SIGTERM to this process at the start of ``SIGNALLED_STEP`` on ``SIGNALLED_RANK``; each
    step's stop decision recorded; every rank's loop ended after ``SIGNALLED_STEP``."""

    def __init__(self) -> None:
        self.decisions: list[dict] = []

    def on_step_begin(self, trainer: Trainer) -> None:
        step = trainer.progress.global_step + 1
        if trainer.ctx.rank == SIGNALLED_RANK and step == SIGNALLED_STEP:
            signal.raise_signal(signal.SIGTERM)  # the trainer's handler notes it

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.decisions.append(
            {"step": metrics["step"], "preempted": trainer.preempted, "stop": trainer.should_stop}
        )
        if metrics["step"] >= SIGNALLED_STEP:
            trainer.should_stop = True  # never run a step the other rank may not run


def _signal_one_rank(ctx: DistContext, out: Path) -> dict:
    callback = SignalOneRank()
    cfg = load_config("sft", [f"run.dir={out / 'run'}", *OVERRIDES])
    trainer = Trainer.from_config(cfg, ctx, [callback])
    try:
        trainer.train()
        error = ""
    except PreemptedError as exc:
        error = str(exc)
    return {"decisions": callback.decisions, "error": error}


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    run_ranks(2, _signal_one_rank, tmp_path)
    ranks = [json.loads((tmp_path / RESULT_FILE.format(rank=r)).read_text()) for r in (0, 1)]
    expected = [
        {"step": 1, "preempted": False, "stop": False},
        {"step": SIGNALLED_STEP, "preempted": True, "stop": True},
    ]
    for rank, result in enumerate(ranks):
        assert result["decisions"] == expected, f"rank {rank} (signalled: rank {SIGNALLED_RANK})"
        assert f"stopped on SIGTERM/SIGINT after step {SIGNALLED_STEP}" in result["error"], rank
