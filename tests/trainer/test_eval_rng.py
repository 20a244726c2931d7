"""Evaluation restores every RNG stream, with an eval loss that draws random numbers.

The shipped objectives draw nothing in eval mode (dropout is off), so an evaluation that
forgot to restore the RNG states would go unnoticed with them. Here the objective's loss
draws from torch's CPU generator, Python's ``random`` and NumPy's global generator, in
training (so the streams shape the gradients) and in evaluation (so an unrestored
evaluation shifts the streams the next training step draws from).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from tasks.compose import load_config
from veoptim.data import bundled_sample_path
from veoptim.distributed import init_distributed
from veoptim.trainer import Callback, Trainer
from veoptim.trainer.objective import LossSum

BASE = ["run.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=2",
        "scheduler.warmup_steps=1", "logging.progress=false", "logging.level=WARNING",
        "export.hf=false", "checkpoint.fsync=false",
        "model.attention_dropout=0.1"]  # fmt: skip
EVAL = [f"data.eval_path={bundled_sample_path()}", "train.eval_every=1"]


class RandomDrawing:
    """The SFT objective, its loss scaled by a factor drawn from all three global RNGs."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.eval_draws = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> LossSum:
        out = self.inner.loss(model, inputs)
        noise = float(torch.rand(())) + random.random() + float(np.random.rand())
        if not model.training:
            self.eval_draws += 1
        return LossSum(out.total * (1 + 1e-2 * noise), out.metrics)


class Losses(Callback):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        self.records.append(dict(metrics))


def _trainer(run_dir: Path, overrides: list[str], callbacks=()) -> Trainer:
    cfg = load_config("sft", [f"run.dir={run_dir}", *BASE, *overrides])
    trainer = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}), list(callbacks))
    trainer.objective = RandomDrawing(trainer.objective)
    return trainer


def _states() -> dict[str, object]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_an_evaluation_that_draws_random_numbers_leaves_every_rng_as_it_was(tmp_path):
    trainer = _trainer(tmp_path, ["train.max_steps=2", EVAL[0]])
    trainer.train_step()
    before = _states()
    first = trainer.evaluate()
    assert trainer.objective.eval_draws == 4  # 8 eval examples, micro-batches of 2
    after = _states()
    changed = [name for name in before if not _same(before[name], after[name])]
    assert changed == [], f"evaluation changed the {changed} RNG state(s)"
    # Same streams, same draws: a second evaluation reports exactly the same numbers.
    assert trainer.evaluate() == first


def test_training_with_random_drawing_evals_is_bitwise_training_without(tmp_path):
    plain_log, eval_log = Losses(), Losses()
    plain = _trainer(tmp_path / "plain", ["train.max_steps=3"], [plain_log])
    plain.train()
    evaluated = _trainer(tmp_path / "eval", ["train.max_steps=3", *EVAL], [eval_log])
    evaluated.train()
    assert evaluated.objective.eval_draws == 3 * 4  # it evaluated after every step
    assert all("eval_loss" in r for r in eval_log.records)
    keys = ("step", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in eval_log.records] == [
        [r[k] for k in keys] for r in plain_log.records
    ]
    a, b = plain.model.state_dict(), evaluated.model.state_dict()
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
