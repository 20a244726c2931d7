"""Metrics sinks: ``<run.dir>/metrics.jsonl`` (always), wandb and TensorBoard (when enabled).

All of them write on rank 0 only. A step after which the trainer evaluated carries the
``eval_*`` values in its metrics and is always logged (whatever ``logging.log_every``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
import time
from pathlib import Path
from typing import Any

from veoptim.config.schema import LoggingConfig
from veoptim.trainer import Callback, Metrics, Trainer
from veoptim.trainer.evaluation import EVAL_PREFIX

log = logging.getLogger(__name__)

#: Subdirectory of run.dir with the TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: Keys every metrics.jsonl record carries (tests check the schema).
METRIC_KEYS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen")
#: The file in run.dir holding the wandb run id every slice of the run continues.
WANDB_ID_FILE = "wandb_run_id"


def _should_log(cfg: LoggingConfig, trainer: Trainer, metrics: Metrics) -> bool:
    step = metrics["step"]
    evaluated = any(name.startswith(EVAL_PREFIX) for name in metrics)
    return step % cfg.log_every == 0 or step == trainer.last_step or evaluated


def tensorboard_tag(name: str) -> str:
    """``eval/<name>`` for an evaluation metric, ``train/<name>`` for the rest."""
    if name.startswith(EVAL_PREFIX):
        return f"eval/{name.removeprefix(EVAL_PREFIX)}"
    return f"train/{name}"


def new_wandb_run_id() -> str:
    """A fresh run id in wandb's form: 8 lower-case letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_run_id(trainer: Trainer) -> str:
    """The run's wandb id: the one its checkpoint restored, else (a full resume from a
    checkpoint saved without wandb) the one in ``<run.dir>/wandb_run_id``, else a new one
    (a fresh start or a weights-only resume is a new run). Recorded in the run's state
    (saved with every checkpoint) and in that file."""
    path = trainer.run_dir / WANDB_ID_FILE
    run_id = trainer.run_ids.wandb
    full_resume = trainer.resumed_from is not None and trainer.cfg.checkpoint.load_optimizer
    if not run_id and full_resume and path.is_file():
        run_id = path.read_text().strip()
    run_id = run_id or new_wandb_run_id()
    trainer.run_ids.wandb = run_id
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def prepare_metrics_file(path: Path, resumed_step: int) -> None:
    """Make ``path`` the history that leads to the state training starts from.

    A resumed run keeps the records up to its checkpoint's step and drops the later
    ones (a crashed run logged them; they are trained again) and any line a crash tore
    (rewritten atomically). A fresh run in a used run dir moves the earlier file aside.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    if resumed_step == 0:
        aside = path.with_name(f"{path.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, aside)
        log.warning("%s held the metrics of an earlier run; moved them to %s", path, aside)
        return
    kept: list[str] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a crash mid-write
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            if record["step"] <= resumed_step:
                kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def append_metrics(path: Path, metrics: Metrics) -> None:
    """Append one record (a JSON object on its own line) to the metrics file ``path``."""
    with path.open("a") as f:
        f.write(json.dumps(metrics) + "\n")


class MetricsFileCallback(Callback):
    """Appends one JSON object per logged step, after :func:`prepare_metrics_file`."""

    def __init__(self, cfg: LoggingConfig) -> None:
        self.cfg = cfg
        self.path: Path | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.ctx.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            self.path = trainer.run_dir / self.cfg.metrics_file
            # progress was restored by the checkpoint callback, which runs first
            prepare_metrics_file(self.path, trainer.progress.global_step)

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.path is None or not _should_log(self.cfg, trainer, metrics):
            return
        append_metrics(self.path, metrics)


class WandbCallback(Callback):
    """Logs metrics and the resolved config to wandb (``logging.wandb.mode``). Every slice of
    a run (``train.stop_at_step``, then ``checkpoint.resume``) continues one wandb run: its id
    is kept in the checkpoints and in ``<run.dir>/wandb_run_id`` (see :func:`wandb_run_id`)."""

    def __init__(self, cfg: LoggingConfig, config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.config = config
        self.run = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if not trainer.ctx.is_main or self.cfg.wandb.mode == "disabled":
            return
        import wandb  # imported lazily: it is slow to import and optional at run time

        self.run = wandb.init(
            project=self.cfg.wandb.project,
            entity=self.cfg.wandb.entity or None,
            name=trainer.cfg.run.name,
            dir=str(trainer.run_dir),
            mode=self.cfg.wandb.mode,
            config=self.config,
            id=wandb_run_id(trainer),
            resume="allow",
        )

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.run is not None and _should_log(self.cfg, trainer, metrics):
            self.run.log(metrics, step=metrics["step"])

    def on_train_end(self, trainer: Trainer) -> None:
        self._finish(0)

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self._finish(1)

    def _finish(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


class TensorBoardCallback(Callback):
    """Logs every metric as the scalar ``train/<name>`` (evaluation: ``eval/<name>``) at the
    global step.

    A resumed run adds a new event file to the same directory; TensorBoard merges them
    by step, so the curves continue where the checkpoint left off. Steps a crashed run
    logged after its last checkpoint are purged (``purge_step``): they are trained again.
    """

    def __init__(self, cfg: LoggingConfig) -> None:
        self.cfg = cfg
        self.writer = None

    def on_train_begin(self, trainer: Trainer) -> None:
        if not trainer.ctx.is_main or not self.cfg.tensorboard:
            return
        # Imported lazily: optional package (availability is checked with the config).
        from torch.utils.tensorboard import SummaryWriter

        resumed_at = trainer.progress.global_step  # restored by the checkpoint callback
        self.writer = SummaryWriter(
            log_dir=str(trainer.run_dir / TENSORBOARD_DIR),
            flush_secs=30,
            purge_step=resumed_at + 1 if resumed_at else None,
        )

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        if self.writer is None or not _should_log(self.cfg, trainer, metrics):
            return
        step = metrics["step"]
        for name, value in metrics.items():
            if name != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(tensorboard_tag(name), value, step)

    def on_train_end(self, trainer: Trainer) -> None:
        self._close()

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
