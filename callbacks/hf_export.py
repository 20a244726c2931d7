"""Hugging Face exports during and at the end of a run, published atomically like checkpoints.

``export.every_steps=N`` publishes ``hf_step_<8 digits>`` every N steps before the last,
and a run that reaches its last step (``train.max_steps`` or ``train.epochs``) publishes ``hf_final`` (the last step is exported
once, under that name), all in ``<run.dir>/exports`` with kind ``hf_export``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from veoptim.config.schema import ExportConfig
from veoptim.export import ExportOptions, ModelState, publish_export, run_format
from veoptim.trainer import Callback, Metrics, Trainer

log = logging.getLogger(__name__)

EXPORTS_SUBDIR = "exports"
HF_EXPORT_NAME = "hf_final"
HF_STEP_PATTERN = "hf_step_{step:08d}"
LORA_EXPORT_NAME = "lora_final"
LORA_STEP_PATTERN = "lora_step_{step:08d}"


def hf_step_name(step: int) -> str:
    """The name of the cadence export at ``step``."""
    return HF_STEP_PATTERN.format(step=step)


def export_name(trainer: Trainer, cfg: ExportConfig, *, final: bool) -> str:
    """``hf_*`` for a full model (a full fine-tune, or merged LoRA), ``lora_*`` for adapters."""
    adapters = trainer.cfg.lora.enabled and not cfg.merge_lora
    if final:
        return LORA_EXPORT_NAME if adapters else HF_EXPORT_NAME
    step = trainer.progress.global_step
    return LORA_STEP_PATTERN.format(step=step) if adapters else hf_step_name(step)


def live_state(trainer: Trainer, exports_root: Path, *, fsync: bool = True) -> ModelState:
    """The training model as the export registry's writers take it."""
    return ModelState(trainer.model, trainer.cfg, trainer.tokenizer,
                      trainer.progress.global_step, exports_root, run=trainer.run_id,
                      origin=str(trainer.run_dir), lora=trainer.cfg.lora.enabled,
                      is_main=trainer.ctx.is_main, fsync=fsync)  # fmt: skip


class HFExportCallback(Callback):
    """Writes ``<run.dir>/exports/hf_step_*`` at the cadence and ``hf_final`` at the end."""

    def __init__(self, cfg: ExportConfig, *, fsync: bool = True) -> None:
        self.cfg = cfg
        self.fsync = fsync

    def on_step_end(self, trainer: Trainer, metrics: Metrics) -> None:
        step, every = trainer.progress.global_step, self.cfg.every_steps
        if every and step % every == 0 and step < trainer.max_steps:
            self.export(trainer, export_name(trainer, self.cfg, final=False))

    def on_train_end(self, trainer: Trainer) -> None:
        if trainer.progress.global_step < trainer.max_steps:
            return  # a time slice (train.stop_at_step) or a stop: the run is not finished
        self.export(trainer, export_name(trainer, self.cfg, final=True))

    def export(self, trainer: Trainer, name: str) -> None:
        """Publish the model as ``name`` through the export registry (collective; rank 0
        writes): the full model, the merged LoRA model, or the PEFT adapter directory."""
        fmt = run_format(trainer.cfg)
        root = trainer.run_dir / EXPORTS_SUBDIR
        state = live_state(trainer, root, fsync=self.fsync)
        options = ExportOptions(dtype=self.cfg.dtype, max_shard_size_mb=self.cfg.max_shard_size_mb)
        publish_export(fmt, state, root, name, options)
        what = "the LoRA adapter (PEFT format)" if fmt == "peft" else "Hugging Face model"
        log.info("exported %s to %s", what, root / name)
