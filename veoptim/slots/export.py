"""A slot's adapter as a PEFT adapter directory: the weights sampling loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veoptim.config.schema import TrainerConfig
from veoptim.export import ExportOptions, ModelState, publish_export
from veoptim.lora.peft_format import peft_adapter_state
from veoptim.slots.routing import SlotParams

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
    spec = params.spec
    adapter = {
        key: _leading_rank(key, tensor, spec.r)
        for key, tensor in peft_adapter_state(model, params.adapter).items()
    }
    lora = dataclasses.replace(cfg.lora, r=spec.r, alpha=spec.alpha, use_rslora=spec.use_rslora)
    state = ModelState(model, dataclasses.replace(cfg, lora=lora), tokenizer, 0, exports_root,
                       origin=name, lora=True, is_main=is_main, fsync=cfg.checkpoint.fsync,
                       adapter=adapter)  # fmt: skip
    options = ExportOptions(dtype=cfg.export.dtype, max_shard_size_mb=cfg.export.max_shard_size_mb)
    publish_export("peft", state, exports_root / SLOT_EXPORTS, name, options)
    return exports_root / SLOT_EXPORTS / name


def _leading_rank(key: str, tensor: torch.Tensor, r: int) -> torch.Tensor:
    """A slot's PEFT tensor cut to its own rank (slots are allocated at lora.r):
    A ``[r_max, in]`` -> ``[r, in]``, B ``[out, r_max]`` -> ``[out, r]``."""
    if key.endswith("lora_A.weight"):
        return tensor[:r].contiguous()
    return tensor[:, :r].contiguous()
