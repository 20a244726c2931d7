"""The built-in model writers of the export registry (``registry.py``), the same live
and offline: ``hf`` writes the full model as a Hugging Face directory, ``merged`` the LoRA
adapters merged into it, ``peft`` the LoRA adapter directory (its base published first as
``hf_base`` where needed: ``publish_base_if_needed``). Each is called on every rank
inside the publication; collectives first, files from rank 0 only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from veoptim.config.schema import TrainerConfig
from veoptim.export.adapters import base_reference, ensure_base_export, write_adapter_dir
from veoptim.export.hf_format import write_hf_export
from veoptim.export.model_state import ExportOptions, ModelState
from veoptim.lora.peft_format import merged_state, peft_adapter_state


def write_hf(state: ModelState, out_dir: Path, options: ExportOptions) -> None:
    """The full model as an HF directory (a full fine-tune)."""
    tensors = state.full_state()  # collective when gathered from a live model
    if state.is_main:
        write_hf_export(tensors, state.model, state.tokenizer, out_dir, dtype=options.dtype,
                        max_shard_size_mb=options.max_shard_size_mb)  # fmt: skip
    del tensors


def write_merged(state: ModelState, out_dir: Path, options: ExportOptions) -> None:
    """The full model with the LoRA adapters folded in."""
    tensors = merged_state(state.model)  # collective
    if state.is_main:
        write_hf_export(tensors, state.model, state.tokenizer, out_dir, dtype=options.dtype,
                        max_shard_size_mb=options.max_shard_size_mb)  # fmt: skip
    del tensors


def with_options(cfg: TrainerConfig, options: ExportOptions) -> TrainerConfig:
    """``cfg`` with ``export.dtype``/``max_shard_size_mb`` as ``options`` say."""
    export = dataclasses.replace(
        cfg.export, dtype=options.dtype, max_shard_size_mb=options.max_shard_size_mb
    )
    return dataclasses.replace(cfg, export=export)


def publish_base_if_needed(state: ModelState, options: ExportOptions) -> None:
    """Before a PEFT adapter is published: its base built from config is published once
    as ``<exports_root>/hf_base`` (collective)."""
    ensure_base_export(state.model, with_options(state.cfg, options), state.tokenizer,
                       state.exports_root, step=state.step, fsync=state.fsync,
                       is_main=state.is_main, run=state.run)  # fmt: skip


def write_peft(state: ModelState, out_dir: Path, options: ExportOptions) -> None:
    """The PEFT adapter directory (``state.adapter``, or the model's own adapters),
    naming its base by ``base_reference``."""
    adapter = state.adapter if state.adapter is not None else peft_adapter_state(state.model)
    if state.is_main:
        base = base_reference(state.cfg, state.exports_root)
        write_adapter_dir(out_dir, adapter, state.cfg, state.model, base, state.tokenizer)
