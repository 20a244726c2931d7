"""The Trainer: owns the loop (micro-batches, accumulation, clipping, optimizer and LR steps).

Data flows one way: config → runtime objects (built in :meth:`Trainer.from_config`)
→ resume → the loop → callbacks. The loop is task-agnostic: the task's
:class:`~veoptim.trainer.objective.Objective` supplies micro-batches and the loss as a
sum plus a normaliser. What a checkpoint holds is the trainer's ``state``: named
components (model, optimizer, LR scheduler, sampler, progress, RNG, config, run ids, and
any the objective or task registers); the checkpointer saves and loads exactly those.
Evaluation (``evaluation.py``) runs after a step, before that step's callbacks, when
``train.eval_every`` or the end of training asks for it.
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

from veoptim.checkpoint import (
    Checkpointer,
    Published,
    Resolved,
    StateComponent,
    check_component_name,
    step_name,
)
from veoptim.config.schema import TrainerConfig
from veoptim.data import GlobalBatchSampler, special_token_ids
from veoptim.distributed import DistContext, ParallelPlan, build_parallel_plan
from veoptim.distributed.agreement import on_rank0
from veoptim.dtypes import LOSS_SCALED_DTYPE
from veoptim.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LiveStateInvalidError,
    PreemptedError,
)
from veoptim.lora.state import LoRAModelState, base_fingerprint
from veoptim.optim import build_optimizer, build_scheduler
from veoptim.optim.loss_scale import DynamicLossScaler
from veoptim.rundir import RunIdentity, locked_run_dir, read_identity, write_identity
from veoptim.state.standard import standard_components, weights_only
from veoptim.trainer.callback import Callback, CallbackList, Metrics
from veoptim.trainer.evaluation import EvalSet, evaluate
from veoptim.trainer.lineage import auto_run, start_run
from veoptim.trainer.loss_scaling import scaled_update
from veoptim.trainer.model_setup import unsharded_model
from veoptim.trainer.objective import MicroBatch, Objective
from veoptim.trainer.preemption import PreemptionGuard, preempted_message
from veoptim.trainer.progress import RunIds, TrainerProgress
from veoptim.trainer.startup import (
    build_sampler,
    check_single_adapter,
    load_inputs,
    resume_option,
    run_length,
    used_root_error,
    weights_hint_checked,
)

log = logging.getLogger(__name__)


def build_checkpointer(cfg: TrainerConfig, run_dir: Path, ctx: DistContext) -> Checkpointer:
    """The run's checkpointer; async saves get their own process group (gloo aborts if
    training reuses the default one)."""
    ckpt = cfg.checkpoint
    async_group = None
    if ckpt.async_save and ctx.world_size > 1:
        async_group = torch.distributed.new_group(backend="gloo")
    return Checkpointer(
        ckpt.root_dir(run_dir),
        keep_last=ckpt.keep_last,
        fsync=ckpt.fsync,
        write_threads=ckpt.write_threads,
        storage_format=ckpt.format,
        async_group=async_group,
    )


def build_loss_scaler(cfg: TrainerConfig) -> DynamicLossScaler | None:
    """The dynamic loss scaler of an fp16 run (None: bf16 and fp32 need none)."""
    if cfg.model.dtype != LOSS_SCALED_DTYPE:
        return None
    return DynamicLossScaler(
        scale=cfg.train.loss_scale_init, growth_interval=cfg.train.loss_scale_growth_interval
    )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and device) RNGs; checkpoints save and restore them."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Trainer:
    """A training run's runtime objects and its loop."""

    cfg: TrainerConfig
    ctx: DistContext
    plan: ParallelPlan
    model: torch.nn.Module
    tokenizer: Any
    objective: Objective
    sampler: GlobalBatchSampler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    callbacks: CallbackList
    run_dir: Path
    checkpointer: Checkpointer
    progress: TrainerProgress = field(default_factory=TrainerProgress)
    #: External identities every slice of the run continues (the wandb run id).
    run_ids: RunIds = field(default_factory=RunIds)
    #: What evaluation runs over (None: no data.eval_path or data.eval_fraction).
    eval_set: EvalSet | None = None
    state: dict[str, StateComponent] = field(default_factory=dict)
    #: fp16 runs: the dynamic loss scaler (None: the loss is not scaled).
    loss_scaler: DynamicLossScaler | None = None
    #: The checkpoint version this run resumed from (None: a fresh start).
    resumed_from: Path | None = None
    #: The run this process trains under (set by :meth:`resume`; ``run.json`` records it).
    identity: RunIdentity | None = None
    should_stop: bool = False
    #: Every rank agreed to stop after this step because some rank got SIGTERM/SIGINT.
    preempted: bool = False
    #: Set when applying a checkpoint failed after live state was written: no more steps.
    state_invalid: bool = False
    _preemption: PreemptionGuard | None = None

    @classmethod
    def from_config(
        cls, cfg: TrainerConfig, ctx: DistContext, callbacks: list[Callback] | None = None
    ) -> Trainer:
        """Build tokenizer, objective, model (with its parallel plan), optimizer, scheduler,
        sampler and checkpointer, and register the standard state components."""
        seed_everything(cfg.train.seed)
        check_single_adapter(cfg, ctx.world_size)
        inputs = load_inputs(cfg)
        tokenizer, objective = inputs.tokenizer, inputs.objective
        special = special_token_ids(tokenizer)
        model, files = unsharded_model(cfg, ctx, len(tokenizer), special)
        plan = build_parallel_plan(
            cfg.parallel, ctx, num_experts=getattr(model.config, "num_experts", 0) or 0
        )
        model = plan.apply(model, shards=files)  # on ctx.device, sharded, weights filled

        def starting_model() -> torch.nn.Module:
            """Another copy of the starting weights: frozen, eval mode, the same plan."""
            copy, files = unsharded_model(cfg, ctx, len(tokenizer), special, with_lora=False)
            copy.requires_grad_(False)
            return plan.apply(copy, shards=files).eval()

        objective.setup(model, starting_model)
        optimizer = build_optimizer(model, cfg.optim)
        sampler = build_sampler(cfg, inputs, dp_rank=plan.dp_rank, dp_size=plan.dp_size)
        scheduler = build_scheduler(optimizer, cfg.scheduler, run_length(cfg, sampler))
        run_dir = Path(cfg.run.dir)
        trainer = cls(
            cfg=cfg,
            ctx=ctx,
            plan=plan,
            model=model,
            tokenizer=tokenizer,
            objective=objective,
            sampler=sampler,
            optimizer=optimizer,
            scheduler=scheduler,
            callbacks=CallbackList(callbacks or []),
            run_dir=run_dir,
            checkpointer=build_checkpointer(cfg, run_dir, ctx),
            eval_set=inputs.eval_set,
            loss_scaler=build_loss_scaler(cfg),
        )
        weights = None
        if cfg.lora.enabled:  # the adapters are saved with what base they belong to
            lora_base = on_rank0(
                lambda: base_fingerprint(
                    model.config, cfg.model.path, cfg.model.init_seed, cfg.model.quant
                ),
                "fingerprinting the base model",
            )  # rank 0 hashes the base's files once
            weights = LoRAModelState(model, lora_base, cfg.lora.allow_other_base)
        standard = standard_components(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=sampler,
            progress=trainer.progress,
            run_ids=trainer.run_ids,
            device=ctx.device,
            world_size=ctx.world_size,
            layout=plan.layout_metadata(),
            config=trainer.recorded_config(),
            defaults=asdict(type(cfg)()),
            weights=weights,
            loss_scaler=trainer.loss_scaler,
        )
        for name, component in standard.items():
            trainer.register_state(name, component)
        for name, component in objective.state_components().items():
            trainer.register_state(name, component)
        return trainer

    def register_state(self, name: str, component: StateComponent) -> None:
        """Checkpoint ``component`` under ``name`` from now on (saved, validated, restored)."""
        check_component_name(name)
        if name in self.state:
            raise CheckpointError(f"a state component named {name!r} is already registered.")
        self.state[name] = component

    @property
    def config_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (what checkpoints record)."""
        return asdict(self.cfg)

    def recorded_config(self) -> dict[str, Any]:
        """The resolved config a checkpoint records, with ``train.max_steps`` the run's
        actual length (from ``train.epochs``, or the default when neither is set), so a
        resume compares what the schedule targets, not how it was asked for."""
        config = self.config_dict
        config["train"] = {**config["train"], "max_steps": self.max_steps}
        return config

    @property
    def max_steps(self) -> int:
        """Optimizer steps of the whole run: ``train.max_steps``, or ``train.epochs`` passes
        of the sampler (the LR schedule targets this)."""
        return self.cfg.train.total_steps(self.sampler.steps_per_epoch)

    @property
    def last_step(self) -> int:
        """The step at which this process stops (``stop_at_step`` slices a longer run)."""
        return self.cfg.train.stop_at_step or self.max_steps

    def resume(self) -> None:
        """Restore ``checkpoint.resume`` (if set) into the live state, before any callback,
        and settle the run this process trains under (``lineage.py``): ``auto`` considers
        only the run dir's run's checkpoints; the run id goes into ``run.json`` and into
        every checkpoint saved from now on.

        A fresh run refuses a checkpoint root that already holds checkpoints (their names
        would be re-pointed) unless ``checkpoint.overwrite``; those of earlier runs are then
        kept under their names and ignored by ``auto`` and by retention.
        """
        cfg = self.cfg.checkpoint
        current = on_rank0(
            lambda: read_identity(self.run_dir), f"reading the run record in {self.run_dir}"
        )
        resolved = None
        if cfg.resume:
            run = auto_run(current)
            try:
                resolved = self.load_checkpoint(
                    cfg.resume, load_optimizer=cfg.load_optimizer, run=run
                )
            except CheckpointError as error:  # its hint of a weights-only load, checked
                weights = self._weights_state()
                checked = weights_hint_checked(error, self.checkpointer, weights, cfg.resume, run)
                if checked is error:
                    raise
                raise checked from error
        elif not cfg.overwrite:
            found = self.checkpointer.latest()  # agreed
            if found is not None:  # the resume it offers is checked to load (agreed)
                weights = self._weights_state()
                option = resume_option(self.checkpointer, self.state, weights, auto_run(current))
                raise used_root_error(self.checkpointer.root, found, *option)
        start = start_run(current, cfg.resume, resolved, full=cfg.load_optimizer)
        for note in start.notes:
            log.info("%s", note)
        if resolved is None and (cfg.overwrite or cfg.resume == "auto"):
            others = self.checkpointer.latest()  # any run's (agreed)
            if others is not None:
                log.info(
                    "earlier runs' checkpoints in %s (newest: %s) stay under their names; "
                    "checkpoint.resume=auto and retention ignore them",
                    self.checkpointer.root, others,
                )  # fmt: skip
        if start.identity != current:
            on_rank0(
                lambda: write_identity(self.run_dir, start.identity, fsync=cfg.fsync),
                f"writing the run record in {self.run_dir}",
            )
        self.identity = start.identity
        self.checkpointer.run = start.identity.run_id
        self.resumed_from = None if resolved is None else resolved.path

    @property
    def run_id(self) -> str | None:
        """The run id this process trains under (None before :meth:`resume`)."""
        return None if self.identity is None else self.identity.run_id

    def load_checkpoint(
        self, ref: str, *, load_optimizer: bool = True, run: str | None = None
    ) -> Resolved | None:
        """Load ``ref`` (``auto``: the newest checkpoint of ``run``, of any run when None; a
        name or a path) into every state component, or only the model weights (checking
        that the model config matches; everything else stays as it is); returns the version
        loaded (None: ``auto`` found no checkpoint). A full load requires the checkpoint's
        components to be exactly the run's."""
        components = self.state if load_optimizer else self._weights_state()
        try:
            restored = self.checkpointer.restore(components, ref, exact=load_optimizer, run=run)
        except LiveStateInvalidError:
            self.state_invalid = True
            raise
        if restored is None:
            log.info(
                "checkpoint.resume=auto: no checkpoint%s in %s",
                "" if run is None else f" of run {run}", self.checkpointer.root,
            )  # fmt: skip
            return None
        resolved, step = restored
        what = ", ".join(components) if load_optimizer else (
            "model weights only (optimizer, scheduler and data position start fresh)"
        )  # fmt: skip
        log.info("restored %s from %s (step %d)", what, resolved.path, step)
        return resolved

    def _weights_state(self) -> dict[str, StateComponent]:
        return weights_only(self.state, self.recorded_config())

    def save_checkpoint(self, name: str = "", *, async_save: bool = False) -> Published | None:
        """Save every state component as ``name`` (default ``step_<global step>``); with
        ``async_save`` it is published by the checkpointer's next ``wait``."""
        step = self.progress.global_step
        full = self.cfg.checkpoint.save_optimizer
        return self.checkpointer.save(
            self.state if full else self._weights_state(),
            name or step_name(step),
            step=step,
            layout=self.plan.layout_metadata().to_json(),
            weights_only=not full,
            async_save=async_save,
        )

    def train(self) -> TrainerProgress:
        """Lock the run dir, resume if asked, then run until ``last_step`` (or until a
        callback sets ``should_stop``); the lock is released when training ends."""
        with locked_run_dir(self.run_dir, "this run"):
            return self._train()

    def _train(self) -> TrainerProgress:
        self.resume()
        self.model.train()
        with PreemptionGuard() as self._preemption:
            try:
                self.callbacks.call("on_train_begin", self)
                while self.progress.global_step < self.last_step and not self.should_stop:
                    if self.sampler.step_in_epoch == 0:
                        self.callbacks.call("on_epoch_begin", self)
                    self.callbacks.call("on_step_begin", self)
                    metrics = self.train_step()
                    if self.eval_due():  # before the step's callbacks: its record and checkpoint
                        metrics.update(self.evaluate())
                    self.callbacks.call("on_step_end", self, metrics)
                    if self.sampler.step_in_epoch == 0:  # the step finished an epoch
                        self.callbacks.call("on_epoch_end", self)
                self.callbacks.call("on_train_end", self)
            except BaseException as error:
                self.callbacks.call("on_exception", self, error)
                raise
            finally:
                self._preemption = None
        if self.preempted:
            saved_in = self.checkpointer.root if self.cfg.checkpoint.save_on_signal else None
            step, ckpt = self.progress.global_step, self.cfg.checkpoint
            raise PreemptedError(preempted_message(step, saved_in, ckpt))
        return self.progress

    def eval_due(self) -> bool:
        """Evaluate after this step: every ``train.eval_every`` steps and at the end of
        training (not after a preemption: the run must stop quickly)."""
        if self.eval_set is None or self.preempted:
            return False
        step, every = self.progress.global_step, self.cfg.train.eval_every
        return step == self.max_steps or bool(every and step % every == 0)

    def evaluate(self) -> Metrics:
        """The objective's loss (and its other eval metrics) over the eval set, as
        ``eval_<name>`` values; then ``on_eval_end``. Collective: call it on every rank."""
        if self.eval_set is None:
            raise ConfigError("evaluation needs data.eval_path or data.eval_fraction.")
        metrics = evaluate(
            self.model,
            self.objective,
            self.eval_set,
            self.plan,
            self.ctx.device,
            self.sampler.micro_batch_size,
        )
        self.callbacks.call("on_eval_end", self, metrics)
        return metrics

    def next_batch(self) -> list[MicroBatch]:
        """This rank's micro-batches of the next global batch (inputs still on the host)."""
        return [self.objective.micro_batch(indices) for indices in self.sampler.next_step()]

    def train_step(self) -> Metrics:
        """One optimizer step over the global batch; returns globally reduced metrics."""
        if self.state_invalid:
            raise CheckpointError(
                "a failed checkpoint load left the live state partly written; this trainer "
                "cannot train any more: start a new process and resume from a checkpoint."
            )
        start = time.perf_counter()
        epoch = self.sampler.epoch
        micro_batches = self.next_batch()
        counts = torch.tensor(
            [sum(b.normaliser for b in micro_batches), sum(b.tokens for b in micro_batches)],
            dtype=torch.float64,
            device=self.ctx.device,
        )
        global_normaliser, global_tokens = self.plan.all_reduce_sum(counts).tolist()
        if global_normaliser == 0:
            raise DataError(
                f"global batch at step {self.progress.global_step} has no "
                f"{self.objective.normaliser_name} to train on."
            )
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        metric_sums: dict[str, torch.Tensor] = {}
        scaler = self.loss_scaler
        for batch in micro_batches:
            inputs = {k: v.to(self.ctx.device) for k, v in batch.inputs.items()}
            out = self.objective.loss(self.model, inputs)
            loss = out.total / global_normaliser
            (loss if scaler is None else loss * scaler.scale).backward()
            loss_sum += loss.detach()
            for name, value in out.metrics.items():
                metric_sums[name] = metric_sums.get(name, 0.0) + value.detach().float()
        lr = self.optimizer.param_groups[0]["lr"]
        max_norm = self.cfg.train.grad_clip or float("inf")
        scaled = None
        if scaler is None:
            # max_norm=inf computes the norm for logging without clipping.
            grad_norm = self.plan.clip_grad_norm_(self.model, max_norm)
            self.optimizer.step()
        else:  # skipped on an overflow: nothing the optimizer owns changes
            step = self.progress.global_step + 1
            scaled = scaled_update(self.plan, self.model, self.optimizer, scaler, max_norm, step)
            grad_norm = scaled.grad_norm
        if scaled is None or not scaled.skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step's last all-reduce also agrees on a stop signal any rank received.
        signalled = float(self._preemption.requested) if self._preemption else 0.0
        stop_signal = torch.tensor(signalled, device=self.ctx.device)
        global_loss, signals = self.plan.all_reduce_sum(torch.stack([loss_sum, stop_signal]))
        if signals > 0:
            self.preempted = self.should_stop = True
        self.progress.global_step += 1
        self.progress.tokens_seen += int(global_tokens)
        elapsed = time.perf_counter() - start
        metrics: Metrics = {
            "step": self.progress.global_step,
            "epoch": epoch,
            "loss": float(global_loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "tokens_per_s": global_tokens / elapsed,
            "tokens_seen": self.progress.tokens_seen,
            "step_time_s": elapsed,
        }
        if scaled is not None:
            metrics["loss_scale"] = scaled.scale
            metrics["skipped_steps"] = scaler.skipped_steps
        if metric_sums:
            reduced = self.plan.all_reduce_sum(torch.stack(list(metric_sums.values())))
            for name, value in zip(
                metric_sums, (reduced / global_normaliser).tolist(), strict=True
            ):
                metrics[name] = value
        return metrics
