"""The Trainer runtime and the callback protocol."""

from veoptim.trainer.callback import Callback, CallbackList, Metrics
from veoptim.trainer.progress import TrainerProgress
from veoptim.trainer.trainer import Trainer, seed_everything

__all__ = ["Callback", "CallbackList", "Metrics", "Trainer", "TrainerProgress", "seed_everything"]
