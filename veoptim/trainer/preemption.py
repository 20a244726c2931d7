"""SIGTERM / SIGINT during training: finish the step, agree across ranks, save, stop.

Schedulers and ``torchrun`` signal every rank before a kill, but not at the same
instant: a rank only *notes* the signal, and the trainer folds the note into the
all-reduce that ends every step, so all ranks stop after the same step. A second
signal exits the process at once (exit code 128 + signal number) without touching
published checkpoints: an unpublished version left behind is cleaned up by the next
save.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType

from veoptim.config.schema import CheckpointConfig

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Installs the handlers for the duration of training (main thread only) and restores
    the previous ones; ``requested`` is the signal number received, or 0."""

    def __init__(self) -> None:
        self.requested = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            os.write(2, f"second {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.requested = signum
        log.warning(
            "%s received: finishing the current step, then saving and stopping "
            "(send it again to exit at once)", signal.Signals(signum).name,
        )  # fmt: skip


def preempted_message(step: int, saved_in: Path | None, ckpt: CheckpointConfig) -> str:
    """What a preempted run tells the user: where it stopped (``step``), where its checkpoint
    is (None: ``checkpoint.save_on_signal=false``) and how to go on: the same command, changed
    as :func:`continue_changes` says."""
    if saved_in is not None:
        saved = f"its checkpoint is in {saved_in}"
    else:
        saved = "nothing was saved (checkpoint.save_on_signal=false)"
    return f"stopped on SIGTERM/SIGINT after step {step}; {saved}. {continue_changes(ckpt)}"


def continue_changes(ckpt: CheckpointConfig) -> str:
    """The same command, changed so that the next start resumes this run's newest checkpoint
    and nothing refuses it: ``checkpoint.resume=auto`` (in place of a resume from elsewhere),
    without ``checkpoint.overwrite=true`` (a fresh start), and its weights only when the run
    saves no optimizer state (a whole resume of a weights-only checkpoint is refused)."""
    drop = [f"checkpoint.resume={ckpt.resume}"] if ckpt.resume not in ("", "auto") else []
    drop += ["checkpoint.overwrite=true"] if ckpt.overwrite else []
    add = [] if ckpt.resume == "auto" else ["checkpoint.resume=auto"]
    if not ckpt.save_optimizer and ckpt.load_optimizer:
        add.append("checkpoint.load_optimizer=false")
    elif ckpt.save_optimizer and not ckpt.load_optimizer:
        add.append("checkpoint.load_optimizer=true")
    text = "Continue with the same command"
    if drop:
        text += f" without {' '.join(drop)}"
    if add:
        text += f"{',' if drop else ''} plus {' '.join(add)}"
    if not ckpt.save_optimizer:
        text += (
            " (from its weights: the run saves no optimizer state, checkpoint.save_optimizer=false)"
        )
    return text + "."
