"""Checkpoint cadence and resume: one mechanism for step, epoch and end-of-training saves."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from veoptim.checkpoint import latest_complete, step_name
from veoptim.checkpoint.checkpointer import Checkpointer, FaultHook
from veoptim.config.schema import CheckpointConfig
from veoptim.distributed.agreement import broadcast_from_rank0
from veoptim.trainer import Callback, Metrics, Trainer

log = logging.getLogger(__name__)

CHECKPOINTS_SUBDIR = "checkpoints"


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """``checkpoint.root``, or ``<run.dir>/checkpoints`` when unset."""
    return Path(cfg.root) if cfg.root else run_dir / CHECKPOINTS_SUBDIR


class CheckpointCallback(Callback):
    """Resumes at train begin; saves every ``save_steps`` / ``save_epochs`` and at train end.

    A step that is both a step save and an epoch save (or the last step) is saved
    once. With ``async_save`` at most one save is in flight: it is finished (and its
    failure raised) at the next save and at train end.
    """

    def __init__(self, cfg: CheckpointConfig, fault_hook: FaultHook | None = None) -> None:
        self.cfg = cfg
        self.fault_hook = fault_hook
        self.checkpointer: Checkpointer | None = None
        self.last_saved_step: int | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        async_group = None
        if self.cfg.async_save and trainer.ctx.world_size > 1:
            # async DCP needs its own group: gloo aborts if training reuses the default one.
            async_group = dist.new_group(backend="gloo")
        self.checkpointer = Checkpointer(
            checkpoint_root(self.cfg, trainer.run_dir),
            keep_last=self.cfg.keep_last,
            fsync=self.cfg.fsync,
            write_threads=self.cfg.write_threads,
            async_group=async_group,
            fault_hook=self.fault_hook,
        )
        if self.cfg.resume:
            self._resume(trainer)

    def _resume(self, trainer: Trainer) -> None:
        assert self.checkpointer is not None
        ref = self.cfg.resume
        if ref == "auto":
            found = latest_complete(self.checkpointer.root) if trainer.ctx.is_main else None
            if broadcast_from_rank0(found) is None:
                log.info(
                    "checkpoint.resume=auto: no checkpoint in %s, starting fresh",
                    self.checkpointer.root,
                )
                return
        self.checkpointer.load(
            trainer.training_state(), ref, load_optimizer=self.cfg.load_optimizer
        )
        self.last_saved_step = trainer.progress.global_step

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.cfg.save_steps and trainer.progress.global_step % self.cfg.save_steps == 0:
            self._save(trainer)

    def on_epoch_end(self, trainer: Trainer) -> None:
        epochs_done = trainer.progress.global_step // trainer.sampler.steps_per_epoch
        if self.cfg.save_epochs and epochs_done % self.cfg.save_epochs == 0:
            self._save(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        sliced = trainer.progress.global_step == trainer.cfg.train.stop_at_step
        if self.cfg.save_at_end or sliced:  # a time slice always saves: it will be resumed
            self._save(trainer)
        assert self.checkpointer is not None
        self._announce(trainer, self.checkpointer.wait())

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        if self.checkpointer is not None:
            dropped = self.checkpointer.abandon()
            if dropped is not None:
                log.warning("async checkpoint %s was not published: training failed", dropped)

    def _save(self, trainer: Trainer) -> None:
        assert self.checkpointer is not None
        step = trainer.progress.global_step
        if step == self.last_saved_step:
            return
        self.last_saved_step = step
        published = self.checkpointer.save(
            trainer.training_state(), step_name(step), async_save=self.cfg.async_save
        )
        self._announce(trainer, published)

    @staticmethod
    def _announce(trainer: Trainer, published) -> None:
        if published is not None:
            log.info("saved checkpoint %s", published.path.parent.parent / published.name)
            trainer.callbacks.call("on_save", trainer, str(published.path))
