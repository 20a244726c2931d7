"""fp16 training in the real trainer: loss scaling, skipped steps, the scaler's checkpoint.

A step whose backward really overflows FP16 (the scale planted far too high for this
model) is skipped: parameters, FP32 masters, moments, step counters and the LR schedule
stay bitwise as they were, the scale halves and the metrics count the skip; the data and
the trainer's step counter move on. Clean steps grow the scale. The scaler's state is a
checkpoint component, restored bitwise, and a run resumed in a new trainer continues
bitwise. The config refuses the fp16 settings that cannot be exact.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tasks.compose import compose_config
from tests.checkpoint.ckpt_state import assert_bitwise_equal, load_with, save_with, snapshot
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.config import to_config
from veoptim.distributed import init_distributed
from veoptim.errors import CheckpointError, ConfigError
from veoptim.state import LOSS_SCALE
from veoptim.trainer import Trainer

FP16 = [
    "run.device=cpu",
    "train.max_steps=8",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "scheduler.warmup_steps=1",
    "logging.progress=false",
    "export.hf=false",
    "checkpoint.fsync=false",
    "model.dtype=fp16",
    "parallel.param_dtype=fp16",
    "optim=master_fp32_adamw",
    "optim.weight_decay=0.1",
]
#: Far above what this model's gradients fit in FP16 when multiplied by it.
OVERFLOWING_SCALE = 2.0**40


def fp16_trainer(run_dir, *extra: str) -> Trainer:
    cfg = to_config(compose_config("sft", [*FP16, f"run.dir={run_dir}", *extra]))
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def scaled_grads_overflow(trainer: Trainer, scale: float) -> bool:
    """Whether the backward of the first examples' loss times ``scale`` leaves an inf or
    nan in an FP16 gradient (the sampler is not touched; gradients are cleared after)."""
    batch = trainer.objective.micro_batch([0, 1])
    out = trainer.objective.loss(trainer.model, batch.inputs)
    (out.total / batch.normaliser * scale).backward()
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    found = any(not torch.isfinite(g).all() for g in grads)
    assert all(g.dtype == torch.float16 for g in grads)
    trainer.optimizer.zero_grad(set_to_none=True)
    return found


def test_a_planted_overflow_is_skipped_halves_the_scale_and_changes_no_optimizer_state(tmp_path):
    trainer = fp16_trainer(tmp_path / "run")
    trainer.resume()
    for _ in range(2):
        assert trainer.train_step()["skipped_steps"] == 0
    scaler = trainer.loss_scaler
    assert scaler is not None and scaler.scale == 2.0**16
    assert not scaled_grads_overflow(trainer, scaler.scale)  # the control: clean at 2**16
    assert scaled_grads_overflow(trainer, OVERFLOWING_SCALE)  # the plant is a real overflow
    before = snapshot(trainer)
    sampler_before, progress_before = before.pop("sampler"), before.pop("progress")
    before.pop("rng")
    scaler.scale = OVERFLOWING_SCALE

    metrics = trainer.train_step()

    assert metrics["loss_scale"] == OVERFLOWING_SCALE  # the scale this step ran with
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert math.isfinite(
        metrics["loss"]
    )  # the unscaled loss was fine: only the backward overflowed
    assert scaler.scale == OVERFLOWING_SCALE / 2 and scaler.clean_steps == 0
    after = snapshot(trainer)
    assert after["progress"]["global_step"] == progress_before["global_step"] + 1
    assert after["sampler"] != sampler_before  # the batch was consumed
    for key in ("params", "state", "groups", "scheduler"):  # masters, moments, steps, LR
        assert_bitwise_equal(before[key], after[key], key)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_clean_steps_grow_the_scale_and_step_the_optimizer(tmp_path):
    trainer = fp16_trainer(
        tmp_path / "run", "train.loss_scale_init=1024", "train.loss_scale_growth_interval=2"
    )
    trainer.resume()
    scales = [trainer.train_step()["loss_scale"] for _ in range(4)]
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11]
    assert trainer.loss_scaler.skipped_steps == 0 and trainer.loss_scaler.scale == 2.0**12
    steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {4.0}  # every parameter took every step
    masters = [s["master_weight"] for s in trainer.optimizer.state.values()]
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())


def _run(trainer: Trainer, steps: int) -> list[dict]:
    out = []
    for _ in range(steps):
        metrics = trainer.train_step()
        out.append({k: v for k, v in metrics.items() if k not in ("tokens_per_s", "step_time_s")})
    return out


#: With growth after every clean step, 2**17 overflows this model's FP16 gradients and
#: 2**16 does not: the run alternates, skipping steps 2 and 4 by itself.
ALTERNATING = ("train.loss_scale_init=65536", "train.loss_scale_growth_interval=1")


def test_a_resumed_fp16_run_continues_bitwise_with_its_loss_scaler(tmp_path):
    """Straight: 5 steps; sliced: 3 steps, a save, a new trainer that loads it and takes
    steps 4 and 5. Real overflows skip steps 2 and 4, on both sides of the save."""
    straight = fp16_trainer(tmp_path / "straight", *ALTERNATING)
    straight.resume()
    curve = _run(straight, 5)
    assert [m["skipped_steps"] for m in curve] == [0, 1, 1, 2, 2]
    assert [m["loss_scale"] for m in curve] == [2.0**16, 2.0**17, 2.0**16, 2.0**17, 2.0**16]

    first = fp16_trainer(tmp_path / "sliced", *ALTERNATING)
    first.resume()
    head = _run(first, 3)
    ckpt = Checkpointer(tmp_path / "ckpts", fsync=False)
    save_with(ckpt, first, "step3")
    saved_scaler = copy.deepcopy(first.loss_scaler)
    second = fp16_trainer(tmp_path / "sliced2", *ALTERNATING)
    second.resume()
    assert second.loss_scaler != saved_scaler
    load_with(ckpt, second, "step3")
    assert second.loss_scaler == saved_scaler  # restored bitwise (a power of two in JSON)
    tail = _run(second, 2)

    assert head + tail == curve
    assert_bitwise_equal(snapshot(straight), snapshot(second))
    assert straight.loss_scaler == second.loss_scaler


def test_a_checkpoint_with_another_loss_scaler_growth_interval_is_refused(tmp_path):
    first = fp16_trainer(tmp_path / "a", "train.loss_scale_growth_interval=3")
    first.resume()
    first.train_step()
    ckpt = Checkpointer(tmp_path / "ckpts", fsync=False)
    save_with(ckpt, first, "s1")
    other = fp16_trainer(tmp_path / "b", "train.loss_scale_growth_interval=4")
    other.resume()
    before = snapshot(other)
    with pytest.raises(CheckpointError, match="grows every 3 clean steps, this run's every 4"):
        load_with(ckpt, other, "s1")
    assert_bitwise_equal(before, snapshot(other))


def test_only_fp16_runs_checkpoint_a_loss_scaler(tmp_path):
    assert LOSS_SCALE in fp16_trainer(tmp_path / "a").state
    cfg = to_config(compose_config("sft", [f"run.dir={tmp_path / 'b'}", "run.device=cpu"]))
    bf16 = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))
    assert LOSS_SCALE not in bf16.state and bf16.loss_scaler is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.dtype=fp16", "parallel.param_dtype=fp16"],
         "model.dtype=fp16 keeps FP32 master weights, which optim=adamw has not"),
        (["model.dtype=fp16", "optim=master_fp32_adamw"],
         "parallel.param_dtype=bf16 would compute in bf16 under FSDP2; set parallel.param_dtype=fp16"),
        (["parallel.param_dtype=fp16"], "loss-scaled only for model.dtype=fp16, but model.dtype=fp32"),
        (["model.dtype=fp16", "parallel.param_dtype=fp16", "optim=full_fp32_adamw",
          "train.loss_scale_init=1000"], "train.loss_scale_init must be a power of two >= 1"),
        (["parallel.reduce_dtype=fp16"], r"parallel.reduce_dtype must be one of \['fp32', 'bf16'\]"),
    ],
)  # fmt: skip
def test_fp16_settings_that_cannot_be_exact_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        to_config(compose_config("sft", overrides))


def test_fp16_moments_are_refused():
    cfg = to_config(compose_config("sft", [
        "model.dtype=fp16", "parallel.param_dtype=fp16", "optim=cpu_offload_adamw",
        "optim.cpu_moment_dtype=fp16", "optim.cpu_offload_param_patterns=[mlp]",
    ]))  # fmt: skip
    from veoptim.optim import build_optimizer

    model = torch.nn.Module()
    model.mlp = torch.nn.Linear(4, 4).half()
    with pytest.raises(ConfigError, match="'offload_moment_dtype' must be one of"):
        build_optimizer(model, cfg.optim)


@pytest.mark.parametrize("task", ["multi_lora", "serve"])
def test_slots_and_the_service_refuse_fp16_in_one_line(task):
    with pytest.raises(ConfigError) as error:
        to_config(compose_config(task, ["model.dtype=fp16", "parallel.param_dtype=fp16"]))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "multi-LoRA slots (tasks.multi_lora, veoptim-serve) do not train in fp16"
    )
