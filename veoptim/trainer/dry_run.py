"""``run.dry_run=true``: everything ``Trainer.from_config`` checks, without training.

The config is validated by the caller (``to_config``); here the data and model paths are
resolved, the tokenizer and the objective's examples (the dataset index) built, the
sampler sized, the scheduler checked against the run's steps, and the model built on the
meta device to count its parameters (no weights read, no optimizer state). Nothing is
written and no process group is needed: under torchrun every rank checks, rank 0 prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from veoptim.checkpoint import latest_complete, resolve_agreed
from veoptim.config.schema import TrainerConfig
from veoptim.data import special_token_ids
from veoptim.distributed import resolve_parallel_sizes
from veoptim.lora import apply_lora
from veoptim.models import build_model
from veoptim.optim import build_scheduler
from veoptim.rundir import holder_of, read_identity
from veoptim.rundir.lock import in_use_error
from veoptim.trainer.lineage import auto_run, describe_start
from veoptim.trainer.startup import (
    build_sampler,
    check_single_adapter,
    load_inputs,
    run_length,
    used_root_error,
)


@dataclass(frozen=True)
class RunPlan:
    """What a run with this config would do."""

    model: str  # model.name, and model.path when set
    arch: str
    parameters: int
    trainable: int
    tokenizer: str
    vocab: int
    train_data: str
    train_examples: int
    eval_examples: int
    max_steps: int
    steps_per_epoch: int
    last_step: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    world_size: int
    checkpoint_dir: Path
    checkpoint_state: str  # what a real run would do with checkpoint_dir
    run_dir: Path

    def lines(self) -> list[str]:
        """The plan as printed by ``run.dry_run=true``."""
        sliced = self.last_step != self.max_steps
        steps = f"{self.max_steps} ({self.steps_per_epoch} per epoch" + (
            f"; this slice stops at {self.last_step})" if sliced else ")"
        )
        rows = [
            ("model", f"{self.model} ({self.arch})"),
            ("parameters", f"{self.parameters:,} ({self.trainable:,} trainable)"),
            ("tokenizer", f"{self.tokenizer} ({self.vocab:,} tokens)"),
            ("train data", f"{self.train_data}: {self.train_examples:,} training examples"
                           + (f", {self.eval_examples:,} eval" if self.eval_examples else "")),
            ("steps", steps),
            ("batch", f"global {self.global_batch} sequences, micro {self.micro_batch} per "
                      f"forward, {self.grad_accum} accumulation steps per rank"),
            ("world size", str(self.world_size)),
            ("checkpoints", f"{self.checkpoint_dir} ({self.checkpoint_state})"),
            ("run dir", str(self.run_dir)),
        ]  # fmt: skip
        return [f"  {name:<12} {value}" for name, value in rows]


def _checkpoint_state(cfg: TrainerConfig, root: Path) -> str:
    """What a real start would do with the checkpoints: the same run record, the same
    resolution (``resolve_agreed``) and the same rules (``lineage.py``)."""
    ckpt, run_dir = cfg.checkpoint, Path(cfg.run.dir)
    holder = holder_of(run_dir)
    if holder is not None:
        raise in_use_error(run_dir, holder, "this run")
    current = read_identity(run_dir)
    if ckpt.resume:
        resolved = resolve_agreed(root, ckpt.resume, run=auto_run(current))
        return describe_start(current, ckpt.resume, resolved, full=ckpt.load_optimizer)
    found = latest_complete(root) if root.is_dir() else None
    if found and not ckpt.overwrite:
        raise used_root_error(root, found)
    if found:
        return (
            f"starts a new run over earlier runs' checkpoints (newest: {found}), which stay "
            "under their names and are ignored by checkpoint.resume=auto and retention"
        )
    return "empty: a fresh run"


def plan_run(cfg: TrainerConfig, world_size: int = 1) -> RunPlan:
    """Check ``cfg`` as ``Trainer.from_config`` would on ``world_size`` ranks; the plan.

    Raises what the real run would raise at startup (``ConfigError``, ``DataError``, ...).
    """
    check_single_adapter(cfg, world_size)
    inputs = load_inputs(cfg)
    tokenizer, holdout, eval_set = inputs.tokenizer, inputs.holdout, inputs.eval_set
    model = build_model(cfg.model, len(tokenizer), special_token_ids(tokenizer), on_meta=True)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora, seed=cfg.model.init_seed)
    resolve_parallel_sizes(cfg.parallel, world_size, getattr(model.config, "num_experts", 0) or 0)
    # every rank reads its own data shard
    sampler = build_sampler(cfg, inputs, dp_rank=0, dp_size=world_size)
    max_steps = run_length(cfg, sampler)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optim.lr)
    build_scheduler(probe, cfg.scheduler, max_steps)  # the schedule's checks, no optimizer state
    params = list(model.parameters())
    root = cfg.checkpoint.root_dir(cfg.run.dir)
    return RunPlan(
        model=cfg.model.name + (f" from {cfg.model.path}" if cfg.model.path else ""),
        arch=model.config.model_type,
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        tokenizer=str(tokenizer.name_or_path),
        vocab=len(tokenizer),
        train_data=str(getattr(cfg.data, "train_path", "")) or "the bundled synthetic data",
        train_examples=len(holdout.train),
        eval_examples=len(eval_set.indices) if eval_set is not None else 0,
        max_steps=max_steps,
        steps_per_epoch=sampler.steps_per_epoch,
        last_step=cfg.train.stop_at_step or max_steps,
        global_batch=cfg.train.global_batch_size,
        micro_batch=sampler.micro_batch_size,
        grad_accum=sampler.grad_accum_steps,
        world_size=world_size,
        checkpoint_dir=root,
        checkpoint_state=_checkpoint_state(cfg, root),
        run_dir=Path(cfg.run.dir),
    )
