"""``train.micro_batch_tokens``: the micro-batch size chosen from a token budget.

Tolerance: the same global batches in fewer, larger micro-batches sum the same terms in
another order: FP32 losses and gradient norms of 4 steps within 1e-6 relative of
``micro_batch_size=1`` (measured ~1e-7). Resume is bitwise with a budget.
"""

from __future__ import annotations

import pytest

from tasks.compose import load_config
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.distributed import init_distributed
from veoptim.errors import ConfigError
from veoptim.trainer import Trainer

BASE = ["run.device=cpu", "logging.progress=false", "logging.level=WARNING", "export.hf=false",
        "checkpoint.fsync=false", "train.global_batch_size=8", "optim.fused=false",
        "train.max_steps=4"]  # fmt: skip
RTOL = 1e-6


def trainer(tmp_path, overrides: list[str], task: str = "sft") -> Trainer:
    cfg = load_config(task, [f"run.dir={tmp_path}", *BASE, *overrides])
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def test_the_budget_picks_the_largest_divisor_that_fits(tmp_path):
    longest = trainer(tmp_path / "a", []).objective.longest_example
    for budget, micro in [(1, 1), (longest, 1), (3 * longest, 2), (4 * longest, 4), (10**6, 8)]:
        t = trainer(tmp_path / str(budget), [f"train.micro_batch_tokens={budget}"])
        assert t.sampler.micro_batch_size == micro, budget
        assert t.sampler.grad_accum_steps == 8 // micro


def test_a_budget_trains_like_single_example_micro_batches(tmp_path):
    curves = {}
    for name, extra in [("one", ["train.micro_batch_size=1"]),
                        ("budget", ["train.micro_batch_tokens=100000"])]:  # fmt: skip
        t = trainer(tmp_path / name, extra)
        t.model.train()
        curves[name] = [(m["loss"], m["grad_norm"]) for m in (t.train_step() for _ in range(4))]
    assert (
        trainer(tmp_path / "c", ["train.micro_batch_tokens=100000"]).sampler.grad_accum_steps == 1
    )
    for (loss, norm), (loss_b, norm_b) in zip(curves["one"], curves["budget"], strict=True):
        assert abs(loss_b - loss) <= RTOL * loss and abs(norm_b - norm) <= RTOL * norm


def test_resume_is_bitwise_with_a_budget(tmp_path):
    common = [*BASE, "train.micro_batch_tokens=200", "model.dtype=bf16", "optim=master_fp32_adamw"]
    straight, sliced = ckpt_io.straight_and_sliced(tmp_path, common, stop=2)
    a = ckpt_io.read_checkpoint(straight / "checkpoints" / step_name(4))
    b = ckpt_io.read_checkpoint(sliced / "checkpoints" / step_name(4))
    assert ckpt_io.differences(a, b) == [] and ckpt_io.metrics(straight) == ckpt_io.metrics(sliced)


def test_a_task_without_a_longest_example_refuses_the_budget(tmp_path):
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=64: this task's objective"):
        trainer(
            tmp_path, ["model=tiny_dense", "model.path=", "train.micro_batch_tokens=64"], task="dpo"
        )
