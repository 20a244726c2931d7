"""Hugging Face export at the end of a finished run, published atomically like checkpoints."""

from __future__ import annotations

import logging

from veoptim.checkpoint import Publisher
from veoptim.checkpoint.hf_export import KIND_HF_EXPORT, full_model_state, write_hf_export
from veoptim.config.schema import CheckpointConfig
from veoptim.trainer import Callback, Trainer

log = logging.getLogger(__name__)

EXPORTS_SUBDIR = "exports"
HF_EXPORT_NAME = "hf_final"


class HFExportCallback(Callback):
    """Writes ``<run.dir>/exports/hf_final`` when the run reaches ``train.max_steps``."""

    def __init__(self, cfg: CheckpointConfig) -> None:
        self.cfg = cfg

    def on_train_end(self, trainer: Trainer) -> None:
        if trainer.progress.global_step < trainer.cfg.train.max_steps:
            return  # a time slice (train.stop_at_step): the run is not finished yet
        state = full_model_state(trainer.model)  # collective
        publisher = Publisher(trainer.run_dir / EXPORTS_SUBDIR, fsync=self.cfg.fsync)
        step = trainer.progress.global_step
        with publisher.write(HF_EXPORT_NAME, kind=KIND_HF_EXPORT, step=step, prunable=False) as out:
            if trainer.ctx.is_main:
                write_hf_export(
                    state,
                    trainer.model.config,
                    trainer.tokenizer,
                    out,
                    dtype=self.cfg.hf_export.dtype,
                    max_shard_size_mb=self.cfg.hf_export.max_shard_size_mb,
                )
        log.info("exported Hugging Face model to %s", publisher.root / HF_EXPORT_NAME)
