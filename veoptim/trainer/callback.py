"""The callback protocol: the trainer calls these hooks; callbacks hold no hidden global state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from veoptim.trainer.trainer import Trainer

Metrics = dict[str, Any]


class Callback:
    """Base class with no-op hooks; override the ones you need.

    Order of calls: (the trainer has already restored ``checkpoint.resume``, so every hook
    sees the restored state) ``on_train_begin`` → (``on_epoch_begin`` → (``on_step_begin`` →
    ``on_step_end``)* → ``on_epoch_end``)* → ``on_train_end``; ``on_eval_end`` after an
    evaluation (before the ``on_step_end`` of the step it followed, whose metrics then also
    hold the ``eval_*`` values); ``on_save`` after a checkpoint is published;
    ``on_exception`` when the loop raises (then the exception propagates).
    """

    def on_train_begin(self, trainer: Trainer) -> None: ...

    def on_epoch_begin(self, trainer: Trainer) -> None: ...

    def on_step_begin(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None: ...

    def on_epoch_end(self, trainer: Trainer) -> None: ...

    def on_eval_end(self, trainer: Trainer, metrics: Metrics) -> None: ...

    def on_save(self, trainer: Trainer, path: str) -> None: ...

    def on_train_end(self, trainer: Trainer) -> None: ...

    def on_exception(self, trainer: Trainer, error: BaseException) -> None: ...


class CallbackList:
    """Dispatches each hook to every callback in order."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def call(self, hook: str, trainer: Trainer, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(trainer, *args)
