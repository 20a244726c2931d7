"""Rank-0 progress bar: step, loss, lr, tokens/s and ETA; a line per evaluation."""

from __future__ import annotations

from tqdm import tqdm

from veoptim.trainer import Callback, Metrics, Trainer


class ProgressCallback(Callback):
    """A tqdm bar over the steps this process will run (tqdm computes the ETA)."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.ctx.is_main:
            self.bar = tqdm(
                total=trainer.last_step,
                initial=trainer.progress.global_step,
                desc=trainer.cfg.run.name,
                dynamic_ncols=True,
            )

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.4f}",
            lr=f"{metrics['lr']:.2e}",
            tok_s=f"{metrics['tokens_per_s']:.0f}",
            refresh=False,
        )
        self.bar.update(1)

    def on_eval_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.bar is None:
            return
        shown = "  ".join(f"{name} {value:.4g}" for name, value in metrics.items())
        self.bar.write(f"step {trainer.progress.global_step}: {shown}")

    def on_train_end(self, trainer: Trainer) -> None:
        self._close()

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
