"""Helpers for checkpoint tests: build a tiny trainer, snapshot its whole live state, compare bitwise."""

from __future__ import annotations

import copy
from typing import Any

import torch

from tasks.compose import compose_config
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.config import to_config
from veoptim.distributed import DistContext, init_distributed
from veoptim.optim.dtensor_util import local
from veoptim.state.rng import capture_rng
from veoptim.trainer import Trainer

TINY = [
    "run.device=cpu",
    "train.max_steps=6",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "scheduler.warmup_steps=1",
    "logging.progress=false",
    "export.hf=false",
    "optim=full_fp32_adamw",
    "model.dtype=bf16",
]


def build_trainer(run_dir, overrides: list[str] = (), ctx: DistContext | None = None) -> Trainer:
    cfg = to_config(compose_config("sft", [*TINY, f"run.dir={run_dir}", *overrides]))
    return Trainer.from_config(cfg, ctx or init_distributed("cpu", "auto", {}))


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """Every piece of live state a checkpoint load could touch, as independent copies."""
    opt = trainer.optimizer
    return {
        "params": {n: local(p).detach().clone() for n, p in trainer.model.named_parameters()},
        "state": {
            i: {k: local(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in enumerate(opt.state[p] for g in opt.param_groups for p in g["params"])
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
        "sampler": trainer.sampler.state_dict(),
        "progress": trainer.progress.state_dict(),
        "rng": capture_rng(trainer.ctx.device),
    }


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Recursive bitwise comparison (tensors by dtype, shape and torch.equal)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"tensor differs at {where}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {where}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def save_with(checkpointer: Checkpointer, trainer: Trainer, name: str):
    """Save the trainer's state as ``name`` through ``checkpointer`` (a root of the test's)."""
    trainer.checkpointer = checkpointer
    return trainer.save_checkpoint(name)


def load_with(checkpointer: Checkpointer, trainer: Trainer, ref: str, **kwargs):
    """Load ``ref`` from ``checkpointer``'s root into the trainer's state."""
    trainer.checkpointer = checkpointer
    return trainer.load_checkpoint(ref, **kwargs)
