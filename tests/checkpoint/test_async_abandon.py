"""An async save still in flight when training fails is not published (and leaves no debris later)."""

from __future__ import annotations

import pytest

from callbacks.checkpoint import CheckpointCallback
from tests.checkpoint.ckpt_state import build_trainer
from veoptim.checkpoint import latest_complete, step_name
from veoptim.trainer import Callback


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, metrics) -> None:
        if trainer.progress.global_step == self.step:
            raise RuntimeError("training blew up")


def test_failed_training_abandons_the_in_flight_async_save(tmp_path):
    overrides = [
        "checkpoint.async_save=true",
        "checkpoint.save_steps=2",
        "checkpoint.save_at_end=false",
    ]
    trainer = build_trainer(tmp_path, overrides)
    callback = CheckpointCallback(trainer.cfg.checkpoint)
    trainer.callbacks.callbacks += [callback, FailAt(3)]
    with pytest.raises(RuntimeError, match="blew up"):
        trainer.train()
    root = trainer.checkpointer.root
    assert latest_complete(root) is None and not (root / step_name(2)).exists()
    # The next run saves normally and removes the abandoned version directory.
    again = build_trainer(tmp_path, ["checkpoint.save_steps=1", "train.stop_at_step=1"])
    again.callbacks.callbacks.append(CheckpointCallback(again.cfg.checkpoint))
    again.train()
    assert latest_complete(root) == step_name(1)
    assert [p.name.split(".")[0] for p in (root / ".versions").iterdir()] == [step_name(1)]
