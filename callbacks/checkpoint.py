"""Checkpoint cadence: one mechanism for step, epoch and end-of-training saves.

Resume is not done here: the trainer restores ``checkpoint.resume`` before the
first hook, so every callback sees the restored state.
"""

from __future__ import annotations

import logging

from veoptim.checkpoint import Published
from veoptim.config.schema import CheckpointConfig
from veoptim.trainer import Callback, Metrics, Trainer

log = logging.getLogger(__name__)


class CheckpointCallback(Callback):
    """Saves every ``save_steps`` / ``save_epochs`` and at train end.

    A step that is both a step save and an epoch save (or the last step) is saved
    once; the step a run resumed from is not saved again. With ``async_save`` at most
    one save is in flight: it is finished (and its failure raised) at the next save
    and at train end.
    """

    def __init__(self, cfg: CheckpointConfig) -> None:
        self.cfg = cfg
        self.last_saved_step: int | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.resumed_from is not None:
            self.last_saved_step = trainer.progress.global_step

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.cfg.save_steps and trainer.progress.global_step % self.cfg.save_steps == 0:
            self._save(trainer)

    def on_epoch_end(self, trainer: Trainer) -> None:
        if self.cfg.save_epochs and trainer.sampler.epoch % self.cfg.save_epochs == 0:
            self._save(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        sliced = trainer.progress.global_step == trainer.cfg.train.stop_at_step
        signalled = trainer.preempted and self.cfg.save_on_signal
        if self.cfg.save_at_end or sliced or signalled:  # slices and preemptions are resumed
            self._save(trainer)
        self._announce(trainer, trainer.checkpointer.wait())

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        dropped = trainer.checkpointer.abandon()
        if dropped is not None:
            log.warning("async checkpoint %s was not published: training failed", dropped)

    def _save(self, trainer: Trainer) -> None:
        step = trainer.progress.global_step
        if step == self.last_saved_step:
            return
        self.last_saved_step = step
        self._announce(trainer, trainer.save_checkpoint(async_save=self.cfg.async_save))

    @staticmethod
    def _announce(trainer: Trainer, published: Published | None) -> None:
        if published is not None:
            log.info("saved checkpoint %s", published.path.parent.parent / published.name)
            trainer.callbacks.call("on_save", trainer, str(published.path))
