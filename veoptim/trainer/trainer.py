"""The Trainer: owns the loop (micro-batches, accumulation, clipping, optimizer and LR steps).

Data flows one way: config → runtime objects (built in :meth:`Trainer.from_config`)
→ the loop → callbacks. Checkpointing, logging and exports are callbacks; the
trainer only exposes the stateful pieces they need (model, optimizer,
scheduler, sampler, progress).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veoptim.checkpoint.checkpointer import TrainingState
from veoptim.config.schema import SFTConfig
from veoptim.data import GlobalBatchSampler, collate, load_sft_dataset, load_tokenizer
from veoptim.distributed import DistContext, ParallelPlan, build_parallel_plan
from veoptim.models import build_model
from veoptim.optim import build_optimizer, build_scheduler
from veoptim.trainer.callback import Callback, CallbackList, Metrics
from veoptim.trainer.loss import count_loss_tokens, summed_token_loss
from veoptim.trainer.progress import TrainerProgress

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and device) RNGs; checkpoints save and restore them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StepBatch:
    """One optimizer step's data on this rank: collated micro-batches and token counts."""

    micro_batches: list[dict[str, torch.Tensor]]
    loss_tokens: int
    input_tokens: int


@dataclass
class Trainer:
    """A training run's runtime objects and its loop."""

    cfg: SFTConfig
    ctx: DistContext
    plan: ParallelPlan
    model: torch.nn.Module
    tokenizer: Any
    dataset: Any
    sampler: GlobalBatchSampler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    callbacks: CallbackList
    run_dir: Path
    progress: TrainerProgress = field(default_factory=TrainerProgress)
    should_stop: bool = False

    @classmethod
    def from_config(
        cls, cfg: SFTConfig, ctx: DistContext, callbacks: list[Callback] | None = None
    ) -> Trainer:
        """Build tokenizer, data, model (with its parallel plan), optimizer and scheduler."""
        seed_everything(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.data.tokenizer_path)
        dataset = load_sft_dataset(
            cfg.data.train_path, tokenizer, cfg.data.max_seq_len, cfg.data.packing
        )
        special = {
            key: getattr(tokenizer, key)
            for key in ("pad_token_id", "bos_token_id", "eos_token_id")
            if getattr(tokenizer, key, None) is not None
        }
        # Ranks other than 0 build without storage; the plan fills their shards from rank 0.
        on_meta = ctx.world_size > 1 and not ctx.is_main
        model = build_model(cfg.model, len(tokenizer), special, on_meta=on_meta)
        plan = build_parallel_plan(
            cfg.parallel, ctx, num_experts=getattr(model.config, "num_experts", 0) or 0
        )
        model = plan.apply(model)  # moves the model to ctx.device, then shards it
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps)
        sampler = GlobalBatchSampler(
            num_examples=len(dataset),
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            dp_rank=plan.dp_rank,
            dp_size=plan.dp_size,
            seed=cfg.train.seed,
            data_fingerprint=dataset.fingerprint,
        )
        return cls(
            cfg=cfg,
            ctx=ctx,
            plan=plan,
            model=model,
            tokenizer=tokenizer,
            dataset=dataset,
            sampler=sampler,
            optimizer=optimizer,
            scheduler=scheduler,
            callbacks=CallbackList(callbacks or []),
            run_dir=Path(cfg.run.dir),
        )

    def training_state(self) -> TrainingState:
        """The stateful objects a checkpoint saves and restores, handed to the Checkpointer."""
        return TrainingState(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
            progress=self.progress,
            layout=self.plan.layout_metadata(),
            config=asdict(self.cfg),
            device=self.ctx.device,
            optimizer_name=self.cfg.optim.name,
        )

    @property
    def last_step(self) -> int:
        """The step at which this process stops (``stop_at_step`` slices a longer run)."""
        return self.cfg.train.stop_at_step or self.cfg.train.max_steps

    def train(self) -> TrainerProgress:
        """Run until ``last_step`` (or until a callback sets ``should_stop``)."""
        self.model.train()
        try:
            self.callbacks.call("on_train_begin", self)
            steps_per_epoch = self.sampler.steps_per_epoch
            while self.progress.global_step < self.last_step and not self.should_stop:
                if self.progress.global_step % steps_per_epoch == 0:
                    self.callbacks.call("on_epoch_begin", self)
                self.callbacks.call("on_step_begin", self)
                metrics = self.train_step()
                self.callbacks.call("on_step_end", self, metrics)
                if self.progress.global_step % steps_per_epoch == 0:
                    self.callbacks.call("on_epoch_end", self)
                    self.progress.epoch = self.progress.global_step // steps_per_epoch
            self.callbacks.call("on_train_end", self)
        except BaseException as error:
            self.callbacks.call("on_exception", self, error)
            raise
        return self.progress

    def next_batch(self) -> StepBatch:
        """Collate this rank's micro-batches of the next global batch and count its tokens."""
        micro_batches = []
        loss_tokens = input_tokens = 0
        for indices in self.sampler.next_step():
            batch = collate([self.dataset[i] for i in indices], self.tokenizer.pad_token_id)
            loss_tokens += int(count_loss_tokens(batch["labels"]))
            input_tokens += int((batch["input_ids"] != self.tokenizer.pad_token_id).sum())
            micro_batches.append({k: v.to(self.ctx.device) for k, v in batch.items()})
        return StepBatch(micro_batches, loss_tokens, input_tokens)

    def train_step(self) -> Metrics:
        """One optimizer step over the global batch; returns globally reduced metrics."""
        start = time.perf_counter()
        step = self.next_batch()
        counts = torch.tensor(
            [step.loss_tokens, step.input_tokens], dtype=torch.float64, device=self.ctx.device
        )
        global_loss_tokens, global_input_tokens = self.plan.all_reduce_sum(counts).tolist()
        if global_loss_tokens == 0:
            raise RuntimeError(
                f"global batch at step {self.progress.global_step} has no response tokens "
                "to train on; check data.max_seq_len and the data's responses."
            )
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for batch in step.micro_batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            # use_cache=False: a KV cache is useless in training and, with packing,
            # transformers would skip the per-example attention masking.
            logits = self.model(**inputs, use_cache=False).logits
            loss = summed_token_loss(logits, batch["labels"]) / global_loss_tokens
            loss.backward()
            loss_sum += loss.detach()
        # max_norm=inf computes the norm for logging without clipping.
        grad_norm = self.plan.clip_grad_norm_(self.model, self.cfg.train.grad_clip or float("inf"))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        global_loss = self.plan.all_reduce_sum(loss_sum)
        self.progress.global_step += 1
        self.progress.tokens_seen += int(global_input_tokens)
        elapsed = time.perf_counter() - start
        return {
            "step": self.progress.global_step,
            "epoch": self.progress.epoch,
            "loss": float(global_loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "tokens_per_s": global_input_tokens / elapsed,
            "tokens_seen": self.progress.tokens_seen,
            "step_time_s": elapsed,
        }
