"""The Trainer runtime, the objective and callback protocols."""

from veoptim.trainer.callback import Callback, CallbackList, Metrics
from veoptim.trainer.objective import LossSum, MicroBatch, Objective
from veoptim.trainer.progress import TrainerProgress
from veoptim.trainer.trainer import Trainer, seed_everything

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
