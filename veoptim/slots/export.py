"""A slot's adapter as a PEFT adapter directory: the weights sampling loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veoptim.config.schema import TrainerConfig
from veoptim.export.adapters import publish_adapter
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
    return publish_adapter(adapter, model, dataclasses.replace(cfg, lora=lora), tokenizer,
                           exports_root, name, subdir=SLOT_EXPORTS, fsync=cfg.checkpoint.fsync,
                           is_main=is_main)  # fmt: skip


def _leading_rank(key: str, tensor: torch.Tensor, r: int) -> torch.Tensor:
    """A slot's PEFT tensor cut to its own rank (slots are allocated at lora.r):
    A ``[r_max, in]`` -> ``[r, in]``, B ``[out, r_max]`` -> ``[out, r]``."""
    if key.endswith("lora_A.weight"):
        return tensor[:r].contiguous()
    return tensor[:, :r].contiguous()
