"""Evaluation on 2 gloo ranks equals 1 rank, and does not change multi-rank training; the
dry run's plan for 2 ranks is what a 2-rank run does.

One spawn runs every 2-rank job (process start dominates); the 1-rank references run in
the test process. The eval set has 5 examples: the ranks' shares (2 and 3) need 1 and 2
micro-batches of 2, so rank 0 repeats a batch it ignores (sharded and expert-parallel
forwards are collectives). FP32 compute; tolerance as in ``tests/distributed``: 2e-5
absolute (only the order of float sums differs), relative for the perplexity (the exp of a
loss; measured: 3e-7 in the loss).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tasks.compose import compose_config
from tasks.runner import dry_run, run_task
from tests.checkpoint.helpers import ckpt_io
from tests.checkpoint.helpers.sft_jobs import job_env
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import step_name
from veoptim.config import to_config
from veoptim.data import bundled_sample_path
from veoptim.distributed import DistContext
from veoptim.trainer import Callback, Trainer

pytestmark = pytest.mark.slow

TOL = 2e-5
BASE = ["run.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=2",
        "scheduler.warmup_steps=1", "logging.progress=false", "logging.level=WARNING",
        "export.hf=false", "checkpoint.fsync=false", "parallel.param_dtype=fp32",
        "data.eval_fraction=0.0017"]  # fmt: skip
#: job: (task, overrides, the 2-rank plan); the 1-rank reference runs parallel=single.
JOBS = {
    "sft": ("sft", [*BASE, "train.max_steps=4", "train.eval_every=2"], "parallel=fsdp"),
    "sft_end_only": ("sft", [*BASE, "train.max_steps=4"], "parallel=fsdp"),
    "moe_ep": ("sft", [*BASE, "model=tiny_moe", "train.max_steps=2", "train.eval_every=1"],
               "parallel=fsdp_ep2"),
    "dpo": ("dpo", [*BASE, "model=tiny_dense", "model.path=", "train.max_steps=2",
                    "train.eval_every=1"], "parallel=fsdp"),
}  # fmt: skip


def _run(run_dir: Path, name: str, ranks: int, env: dict) -> None:
    task, overrides, two_rank_plan = JOBS[name]
    extra = [two_rank_plan] if ranks == 2 else []
    run_task(compose_config(task, [f"run.dir={run_dir}", *overrides, *extra]), env=env)


#: By epochs over the 8 bundled sample examples: 2 steps per epoch, 2 epochs; micro-batches
#: of 1 on 2 ranks are 2 accumulation steps per rank (4 in one process).
PLANNED = ["run.device=cpu", f"data.train_path={bundled_sample_path()}", "train.max_steps=0",
           "train.epochs=2", "train.global_batch_size=4", "train.micro_batch_size=1",
           "scheduler.warmup_steps=1", "logging.progress=false", "export.hf=false",
           "checkpoint.fsync=false", "parallel=fsdp"]  # fmt: skip
PLAN_FILE = "dry_run_plan.json"


class MicroBatchCounter(Callback):
    """This rank's micro-batches of each step, counted where the trainer collates them."""

    def __init__(self, trainer: Trainer) -> None:
        self.per_step: list[int] = []
        self._count = 0
        collate = trainer.objective.micro_batch

        def counted(indices: list[int]):
            self._count += 1
            return collate(indices)

        trainer.objective.micro_batch = counted

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.per_step.append(self._count)
        self._count = 0


def _plan_and_run(ctx: DistContext, out: Path) -> dict:
    """The printed dry-run plan on these ranks, then the real run of the same config."""
    config = to_config(compose_config("sft", [f"run.dir={out}", *PLANNED, "run.dry_run=true"]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        dry_run(config, job_env(ctx))
    config.run.dry_run = False
    trainer = Trainer.from_config(config, ctx)
    counter = MicroBatchCounter(trainer)
    trainer.callbacks.callbacks.append(counter)
    trainer.train()
    return {"printed": printed.getvalue(), "steps_per_epoch": trainer.sampler.steps_per_epoch,
            "max_steps": trainer.max_steps, "steps_run": trainer.progress.global_step,
            "micro_batches": counter.per_step}  # fmt: skip


def _two_rank_jobs(ctx: DistContext, out: Path) -> dict:
    for name in JOBS:
        _run(out / name, name, 2, job_env(ctx))
    planned = _plan_and_run(ctx, out / "planned")
    if ctx.rank == 0:
        (out / PLAN_FILE).write_text(json.dumps(planned))
    return {}


def _evals(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [{k: v for k, v in r.items() if k.startswith("eval_") or k == "step"} for r in records
            if "eval_loss" in r]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    two = tmp_path_factory.mktemp("two_ranks")
    run_ranks(2, _two_rank_jobs, two)
    one = tmp_path_factory.mktemp("one_rank")
    for name in ("sft", "moe_ep", "dpo"):
        _run(one / name, name, 1, {})
    return one, two


@pytest.mark.parametrize("name", ["sft", "moe_ep", "dpo"])
def test_eval_on_two_ranks_equals_one_rank(runs, name):
    one, two = runs
    expected, found = _evals(one / name), _evals(two / name)
    steps = {"sft": [2, 4], "moe_ep": [1, 2], "dpo": [1, 2]}[name]
    assert [r["step"] for r in found] == [r["step"] for r in expected] == steps
    for a, b in zip(expected, found, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), (key, a[key], b[key])
    keys = set(found[0])
    if name == "dpo":
        assert {"eval_rewards/accuracies", "eval_rewards/margins"} <= keys
        assert "eval_perplexity" not in keys
    else:
        assert "eval_perplexity" in keys


def test_eval_does_not_change_two_rank_training(runs):
    _, two = runs
    a = ckpt_io.read_checkpoint(two / "sft" / "checkpoints" / step_name(4))
    b = ckpt_io.read_checkpoint(two / "sft_end_only" / "checkpoints" / step_name(4))
    assert ckpt_io.differences(a, b) == []
    assert ckpt_io.metrics(two / "sft") == ckpt_io.metrics(two / "sft_end_only")
    assert [r["step"] for r in _evals(two / "sft_end_only")] == [4]


def test_the_dry_run_plan_for_two_ranks_is_what_two_ranks_do(runs):
    _, two = runs
    planned = json.loads((two / PLAN_FILE).read_text())
    lines = planned["printed"].splitlines()
    assert lines[0].startswith("dry run: the config is valid")
    plan = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[1:])
    assert plan["world size"] == "2"
    # the real run: 2 steps per epoch, 2 epochs, 2 micro-batches per rank in every step
    assert (planned["steps_per_epoch"], planned["max_steps"], planned["steps_run"]) == (2, 4, 4)
    assert planned["micro_batches"] == [2, 2, 2, 2]
    assert plan["steps"] == "4 (2 per epoch)"
    assert plan["batch"] == "global 4 sequences, micro 1 per forward, 2 accumulation steps per rank"
