"""Evaluation on one rank: the numbers are the objective's loss over the eval examples, the
hold-out is never trained on, and evaluating does not change training (bitwise).

Multi-rank evaluation (2 gloo ranks against 1) is in ``test_eval_ranks.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from callbacks.metrics import TENSORBOARD_DIR
from tasks.compose import compose_config, load_config
from tasks.runner import run_task
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.data import GlobalBatchSampler, bundled_sample_path
from veoptim.data.holdout import Holdout, split_holdout
from veoptim.distributed import init_distributed
from veoptim.errors import CheckpointError
from veoptim.trainer import Trainer

BASE = ["run.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=2",
        "scheduler.warmup_steps=1", "logging.progress=false", "logging.level=WARNING",
        "export.hf=false", "checkpoint.fsync=false"]  # fmt: skip
#: Dropout makes a run consume RNG in train mode: an eval that left the model in eval mode
#: or drew random numbers would change the training that follows.
DROPOUT = "model.attention_dropout=0.1"
DPO_TINY = [*BASE, "model=tiny_dense", "model.path=", "optim.lr=1e-3"]


def _trainer(task: str, run_dir: Path, overrides: list[str]) -> Trainer:
    cfg = load_config(task, [f"run.dir={run_dir}", *overrides])
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}), [])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _direct(trainer: Trainer) -> tuple[float, dict[str, float]]:
    """The eval set's loss and metric means, one example at a time, without the evaluator."""
    eval_set = trainer.eval_set
    total, count, sums = 0.0, 0, {}
    trainer.model.eval()
    with torch.no_grad():
        for index in eval_set.indices:
            batch = eval_set.data.micro_batch([index])
            out = trainer.objective.loss(trainer.model, batch.inputs)
            total += float(out.total)
            count += batch.normaliser
            for name, value in out.metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)
    trainer.model.train()
    return total / count, {name: value / count for name, value in sums.items()}


def test_sft_eval_file_equals_a_direct_computation(tmp_path):
    trainer = _trainer("sft", tmp_path, [*BASE, "train.max_steps=2", DROPOUT,
                                         f"data.eval_path={bundled_sample_path()}"])  # fmt: skip
    assert trainer.eval_set is not None and len(trainer.eval_set.indices) == 8
    assert trainer.eval_set.data is not trainer.objective  # read from the eval file
    trainer.train_step()
    rng = torch.get_rng_state()
    metrics = trainer.evaluate()
    assert trainer.model.training and torch.equal(torch.get_rng_state(), rng)
    loss, _ = _direct(trainer)
    assert set(metrics) == {"eval_loss", "eval_perplexity"}
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_dpo_eval_reports_rewards_not_perplexity(tmp_path):
    trainer = _trainer("dpo", tmp_path, [*DPO_TINY, "train.max_steps=2",
                                         "data.eval_fraction=0.003"])  # fmt: skip
    assert len(trainer.eval_set.indices) == 9 and trainer.eval_set.data is trainer.objective
    trainer.train_step()
    trainer.train_step()
    metrics = trainer.evaluate()
    loss, means = _direct(trainer)
    assert "eval_perplexity" not in metrics
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-5)
    for name in ("rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert metrics[f"eval_{name}"] == pytest.approx(means[name], rel=1e-5, abs=1e-7), name


def test_held_out_examples_are_never_trained_on(tmp_path):
    sample = f"data.train_path={bundled_sample_path()}"  # 8 examples
    trainer = _trainer("sft", tmp_path, [*BASE, sample, "data.eval_fraction=0.25",
                                         "train.global_batch_size=2", "train.micro_batch_size=1"])  # fmt: skip
    held_out = set(trainer.eval_set.indices)
    assert len(held_out) == 2 and trainer.sampler.num_examples == 6
    seen: list[int] = []
    for _ in range(3 * trainer.sampler.steps_per_epoch):  # three epochs
        seen += [i for micro in trainer.sampler.next_step() for i in micro]
    assert not held_out & set(seen)
    for epoch in range(3):  # every training example once per epoch
        assert sorted(seen[epoch * 6 : (epoch + 1) * 6]) == sorted(set(range(8)) - held_out)
    # The split depends on neither train.seed nor anything else but the size and fraction.
    assert split_holdout(8, 0.25) == split_holdout(8, 0.25)
    other = _trainer("sft", tmp_path, [*BASE, sample, "data.eval_fraction=0.25", "train.seed=7",
                                       "train.global_batch_size=2", "train.micro_batch_size=1"])  # fmt: skip
    assert set(other.eval_set.indices) == held_out


def test_sampler_state_of_another_split_is_refused():
    fingerprint = "f" * 64
    sizes = dict(global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0)

    def sampler(split: Holdout) -> GlobalBatchSampler:
        return GlobalBatchSampler(num_examples=len(split.train), **sizes, indices=split.train,
                                  data_fingerprint=split.fingerprint(fingerprint))  # fmt: skip

    assert split_holdout(100, 0.0).fingerprint(fingerprint) == fingerprint  # nothing held out
    split = split_holdout(100, 0.1)
    first_ten = Holdout(train=list(range(10, 100)), eval=list(range(10)))  # as many, others
    assert split.eval != first_ten.eval
    saved = sampler(split).state_dict()
    with pytest.raises(CheckpointError, match="fingerprint"):
        sampler(first_ten).load_state_dict(saved)
    sampler(split).load_state_dict(saved)


def test_eval_rows_in_metrics_jsonl_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    run_task(compose_config("sft", [f"run.dir={run_dir}", *BASE, "train.max_steps=5",
                                    "data.eval_fraction=0.002", "train.eval_every=2",
                                    "logging.log_every=100", "logging.tensorboard=true"]))  # fmt: skip
    records = _records(run_dir)
    # log_every=100 logs only the last step, but every evaluated step is logged too.
    assert [r["step"] for r in records] == [2, 4, 5]
    for record in records:
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
        assert record["loss"] > 0
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    scalars = {(e.step, e.value) for e in events.Scalars("eval/loss")}
    expected = {(r["step"], torch.tensor(r["eval_loss"]).float().item()) for r in records}
    assert scalars == expected
    assert "eval/perplexity" in events.Tags()["scalars"]
    assert "train/eval_loss" not in events.Tags()["scalars"]


def test_eval_does_not_change_training_bitwise(tmp_path):
    common = [*BASE, DROPOUT, "train.max_steps=4"]
    run_task(compose_config("sft", [f"run.dir={tmp_path / 'plain'}", *common]))
    run_task(compose_config("sft", [f"run.dir={tmp_path / 'eval'}", *common,
                                    f"data.eval_path={bundled_sample_path()}",
                                    "train.eval_every=1"]))  # fmt: skip
    plain = ckpt_io.read_checkpoint(tmp_path / "plain" / "checkpoints" / step_name(4))
    evaluated = ckpt_io.read_checkpoint(tmp_path / "eval" / "checkpoints" / step_name(4))
    assert ckpt_io.differences(plain, evaluated) == []
    assert ckpt_io.metrics(tmp_path / "plain") == ckpt_io.metrics(tmp_path / "eval")
    assert all("eval_loss" in r for r in _records(tmp_path / "eval"))


def test_resume_with_eval_is_bitwise(tmp_path):
    common = [*BASE, DROPOUT, "train.max_steps=6", "data.eval_fraction=0.002",
              "train.eval_every=2"]  # fmt: skip
    straight_dir, sliced_dir = ckpt_io.straight_and_sliced(tmp_path, common, stop=3)
    a = ckpt_io.read_checkpoint(straight_dir / "checkpoints" / step_name(6))
    b = ckpt_io.read_checkpoint(sliced_dir / "checkpoints" / step_name(6))
    assert ckpt_io.differences(a, b) == []
    straight, resumed = _records(straight_dir), _records(sliced_dir)
    assert ckpt_io.metrics(straight_dir) == ckpt_io.metrics(sliced_dir)
    evals = [(r["step"], r["eval_loss"]) for r in straight if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4, 6]
    assert evals == [(r["step"], r["eval_loss"]) for r in resumed if "eval_loss" in r]
