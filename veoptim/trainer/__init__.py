"""The Trainer runtime, the objective and callback protocols.

The names below are imported on first use (PEP 562): a task command imports this package
to declare its callbacks and checks its command line before torch and the trainer load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names

if TYPE_CHECKING:
    from veoptim.trainer.callback import Callback, CallbackList, Metrics
    from veoptim.trainer.objective import LossSum, MicroBatch, Objective
    from veoptim.trainer.progress import TrainerProgress
    from veoptim.trainer.trainer import Trainer, seed_everything

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "Callback": "callback",
    "CallbackList": "callback",
    "Metrics": "callback",
    "LossSum": "objective",
    "MicroBatch": "objective",
    "Objective": "objective",
    "TrainerProgress": "progress",
    "Trainer": "trainer",
    "seed_everything": "trainer",
}

__all__ = [
    "Callback",
    "CallbackList",
    "LossSum",
    "Metrics",
    "MicroBatch",
    "Objective",
    "Trainer",
    "TrainerProgress",
    "seed_everything",
]

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
