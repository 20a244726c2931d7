"""``model.compile``: compiled decoder layers train like eager ones within rounding, keep
every parameter name, and resume bitwise.

Tolerance: FP32, 4 steps of the tiny model: losses and gradient norms within 1e-5
relative of eager (measured 9e-8: inductor fuses the element-wise work and rounds in
another order).
"""

from __future__ import annotations

import pytest
import torch

from tasks.compose import load_config
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.distributed import init_distributed
from veoptim.trainer import Trainer

pytestmark = pytest.mark.slow

BASE = ["run.device=cpu", "logging.progress=false", "logging.level=WARNING", "export.hf=false",
        "checkpoint.fsync=false", "train.global_batch_size=8", "train.micro_batch_size=4",
        "optim.fused=false", "train.max_steps=4"]  # fmt: skip
RTOL = 1e-5


def curve(tmp_path, overrides: list[str]) -> tuple[Trainer, list[tuple[float, float]]]:
    cfg = load_config("sft", [f"run.dir={tmp_path}", *BASE, *overrides])
    trainer = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))
    trainer.model.train()
    return trainer, [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(4))]


def test_compiled_layers_train_like_eager_ones(tmp_path):
    torch._dynamo.reset()
    eager, eager_curve = curve(tmp_path / "eager", [])
    compiled, compiled_curve = curve(tmp_path / "compiled", ["model.compile=true"])
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    layers = compiled.model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    for (loss, norm), (loss_c, norm_c) in zip(eager_curve, compiled_curve, strict=True):
        assert abs(loss_c - loss) <= RTOL * loss and abs(norm_c - norm) <= RTOL * norm


def test_resume_is_bitwise_compiled(tmp_path):
    common = [*BASE, "model.compile=true", "model.dtype=bf16", "optim=master_fp32_adamw"]
    straight, sliced = ckpt_io.straight_and_sliced(tmp_path, common, stop=2)
    a = ckpt_io.read_checkpoint(straight / "checkpoints" / step_name(4))
    b = ckpt_io.read_checkpoint(sliced / "checkpoints" / step_name(4))
    assert ckpt_io.differences(a, b) == [] and ckpt_io.metrics(straight) == ckpt_io.metrics(sliced)
