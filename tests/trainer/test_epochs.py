"""Run length by epochs, warmup by ratio, and the config errors of run length and evaluation."""

from __future__ import annotations

import pytest

from tasks.compose import load_config
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.config.schema import DEFAULT_MAX_STEPS, SchedulerConfig
from veoptim.data import bundled_sample_path
from veoptim.distributed import init_distributed
from veoptim.errors import ConfigError, DataError
from veoptim.optim.schedulers import lr_factor
from veoptim.trainer import Callback, Metrics, Trainer

SAMPLE = f"data.train_path={bundled_sample_path()}"  # 8 examples
BASE = ["run.device=cpu", SAMPLE, "train.global_batch_size=2", "train.micro_batch_size=1",
        "scheduler.warmup_steps=0", "logging.progress=false", "logging.level=WARNING",
        "export.hf=false", "checkpoint.fsync=false"]  # fmt: skip


class IndexRecorder(Callback):
    """The example indices each step trained on (read from the real sampler's next step)."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.epochs: list[int] = []

    def on_step_begin(self, trainer: Trainer) -> None:
        sampler = trainer.sampler
        batch = sampler.global_batch(sampler.epoch, sampler.step_in_epoch)
        self.steps.append(batch)

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        self.epochs.append(metrics["epoch"])


def _trainer(run_dir, overrides: list[str], callbacks=()) -> Trainer:
    cfg = load_config("sft", [f"run.dir={run_dir}", *overrides])
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}), list(callbacks))


def test_epochs_set_the_steps_and_cover_each_example_once_per_epoch(tmp_path):
    recorder = IndexRecorder()
    trainer = _trainer(tmp_path, [*BASE, "train.epochs=3"], [recorder])
    assert trainer.cfg.train.max_steps == 0  # train.epochs alone, as on the command line
    assert trainer.max_steps == 3 * 4 and trainer.scheduler.max_steps == 12
    assert trainer.train().global_step == 12
    assert recorder.epochs == [0] * 4 + [1] * 4 + [2] * 4
    for epoch in range(3):
        seen = sorted(i for step in recorder.steps[epoch * 4 : (epoch + 1) * 4] for i in step)
        assert seen == list(range(8))
    # The schedule ends where a max_steps=12 run's does.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.cfg.optim.lr * lr_factor(trainer.cfg.scheduler, 12, 12)
    )


def test_epochs_after_the_hold_out_and_with_a_warmup_ratio(tmp_path):
    recorder = IndexRecorder()
    overrides = [*BASE, "train.epochs=2", "data.eval_fraction=0.25", "scheduler.warmup_ratio=0.5"]
    trainer = _trainer(tmp_path, overrides, [recorder])
    held_out = set(trainer.eval_set.indices)
    assert trainer.sampler.steps_per_epoch == 3 and trainer.max_steps == 6
    lrs = [trainer.optimizer.param_groups[0]["lr"]]
    trainer.train()
    for epoch in range(2):
        seen = sorted(i for step in recorder.steps[epoch * 3 : (epoch + 1) * 3] for i in step)
        assert seen == sorted(set(range(8)) - held_out)
    # warmup_ratio=0.5 of 6 steps is a 3-step warmup.
    warm = SchedulerConfig(name="cosine", warmup_steps=3)
    assert lrs[0] == pytest.approx(trainer.cfg.optim.lr * lr_factor(warm, 6, 0))


def test_warmup_ratio_schedule_equals_the_warmup_steps_it_stands_for():
    for name in ("constant", "linear", "cosine", "wsd"):
        ratio = SchedulerConfig(name=name, warmup_steps=0, warmup_ratio=0.1)
        steps = SchedulerConfig(name=name, warmup_steps=5)
        assert [lr_factor(ratio, 50, s) for s in range(50)] == [
            lr_factor(steps, 50, s) for s in range(50)
        ], name
    ratio = SchedulerConfig(name="linear", warmup_steps=0, warmup_ratio=0.1)
    assert [lr_factor(ratio, 50, s) for s in range(3)] == [1 / 6, 2 / 6, 3 / 6]


def test_resume_of_an_epoch_run_is_bitwise(tmp_path):
    common = [*BASE, "train.epochs=2", "data.eval_fraction=0.25", "train.eval_every=2"]
    straight, sliced = ckpt_io.straight_and_sliced(tmp_path, common, stop=4)
    a = ckpt_io.read_checkpoint(straight / "checkpoints" / step_name(6))
    b = ckpt_io.read_checkpoint(sliced / "checkpoints" / step_name(6))
    assert ckpt_io.differences(a, b) == []
    assert ckpt_io.metrics(straight) == ckpt_io.metrics(sliced)


def test_default_run_length_is_unchanged():
    cfg = load_config("sft", ["run.device=cpu"])
    assert (cfg.train.max_steps, cfg.train.epochs) == (0, 0)
    assert cfg.train.total_steps(steps_per_epoch=187) == DEFAULT_MAX_STEPS == 1000
    dpo = load_config("dpo", [], resolve_model=False)  # its default base is the demo's export
    assert dpo.train.total_steps(steps_per_epoch=187) == 100


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["train.max_steps=10", "train.epochs=2"], ["train.max_steps", "train.epochs"]),
        (["train.epochs=-1"], ["train.epochs"]),
        (
            ["scheduler.warmup_steps=5", "scheduler.warmup_ratio=0.1"],
            ["scheduler.warmup_ratio", "scheduler.warmup_steps"],
        ),
        (["scheduler.warmup_steps=0", "scheduler.warmup_ratio=1.0"], ["scheduler.warmup_ratio"]),
        (["data.eval_fraction=1.0"], ["data.eval_fraction"]),
        (["data.eval_fraction=0.1", "data.eval_path=x.jsonl"], ["data.eval_path", "data.eval_fraction"]),
        (["train.eval_every=10"], ["train.eval_every", "data.eval_path", "data.eval_fraction"]),
        (["train.stop_at_step=1001"], ["train.stop_at_step", "train.max_steps"]),
    ],
)  # fmt: skip
def test_config_errors_name_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as info:
        load_config("sft", ["run.device=cpu", *overrides])
    for key in keys:
        assert key in str(info.value), (key, str(info.value))


def test_errors_known_only_once_the_data_is_loaded(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.stop_at_step \(9\).*8 steps"):
        _trainer(tmp_path, [*BASE, "train.epochs=2", "train.stop_at_step=9"])
    with pytest.raises(DataError, match="data.eval_fraction"):
        _trainer(tmp_path, [*BASE, "data.eval_fraction=0.95"])
