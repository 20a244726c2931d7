"""A slot's adapter as a PEFT adapter directory: the weights a sampler loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veoptim.checkpoint.hf_export import KIND_HF_EXPORT
from veoptim.checkpoint.publish import Publisher
from veoptim.config.schema import TrainerConfig
from veoptim.distributed.agreement import on_rank0
from veoptim.export.lora_formats import (
    base_reference,
    needs_base_export,
    publish_base,
    write_adapter_dir,
)
from veoptim.lora.peft_format import base_state, peft_adapter_state
from veoptim.lora.slots.routing import SlotParams

SLOT_EXPORTS = "slots"


def publish_slot_adapter(
    model: nn.Module,
    params: SlotParams,
    name: str,
    cfg: TrainerConfig,
    tokenizer: Any,
    exports_root: Path,
    *,
    is_main: bool,
) -> Path:
    """Publish ``params``' adapter, cut to its rank, as ``<exports_root>/slots/<name>``
    (collective). A base built from config is published once as ``<exports_root>/hf_base``
    and named as the adapter's base, so PEFT can load it without this process."""
    fsync = cfg.checkpoint.fsync
    if on_rank0(
        lambda: needs_base_export(cfg, exports_root, model),
        f"checking the base export in {exports_root}",
    ):
        publish_base(base_state(model), model, tokenizer, exports_root, cfg=cfg, step=0,
                     dtype=cfg.export.dtype, max_shard_size_mb=cfg.export.max_shard_size_mb,
                     fsync=fsync, is_main=is_main)  # fmt: skip
    spec = params.spec
    adapter = {
        key: _leading_rank(key, tensor, spec.r)
        for key, tensor in peft_adapter_state(model, params.adapter).items()
    }
    lora = dataclasses.replace(cfg.lora, r=spec.r, alpha=spec.alpha, use_rslora=spec.use_rslora)
    slot_cfg = dataclasses.replace(cfg, lora=lora)
    root = exports_root / SLOT_EXPORTS
    with Publisher(root, fsync=fsync).write(name, kind=KIND_HF_EXPORT, prunable=False) as out:
        if is_main:
            write_adapter_dir(out, adapter, slot_cfg, model, base_reference(cfg, exports_root))
    return root / name


def _leading_rank(key: str, tensor: torch.Tensor, r: int) -> torch.Tensor:
    """A slot's PEFT tensor cut to its own rank (slots are allocated at lora.r):
    A ``[r_max, in]`` -> ``[r, in]``, B ``[out, r_max]`` -> ``[out, r]``."""
    if key.endswith("lora_A.weight"):
        return tensor[:r].contiguous()
    return tensor[:, :r].contiguous()
