"""The LoRA model of a checkpoint, rebuilt offline for ``veoptim-export --format
peft|merged`` (the registry then calls the same writers as a live export).

A LoRA checkpoint holds the adapters and a fingerprint of the frozen base, not the base.
Offline, the base is rebuilt (from ``model.path``, or from config with ``model.init_seed``),
checked against the fingerprint, and the adapters are read into it from DCP.
"""

from __future__ import annotations

import logging

from torch import nn

from veoptim.checkpoint import read_json, shared_json_path
from veoptim.data import special_token_ids
from veoptim.errors import CheckpointError
from veoptim.export.source import CheckpointSource, read_model_tensors
from veoptim.lora import apply_lora
from veoptim.lora.state import (
    ALLOW_FLAG,
    BASE,
    base_fingerprint,
    base_mismatch,
    fingerprint_differences,
    refuse_other_base,
)
from veoptim.models import build_model
from veoptim.state import MODEL
from veoptim.state.model import module_inventory

log = logging.getLogger(__name__)


def lora_model(source: CheckpointSource, allow_other_base: bool = False) -> nn.Module:
    """The base with real weights, checked against the checkpoint's fingerprint (its
    content too: a base retrained under the same path is refused unless
    ``allow_other_base``), plus the adapters read from DCP."""
    cfg = source.cfg
    special = special_token_ids(source.tokenizer)
    model = build_model(cfg.model, len(source.tokenizer), special)
    saved = read_json(shared_json_path(source.version, MODEL))
    if not isinstance(saved, dict) or not isinstance(saved.get(BASE), dict):
        raise CheckpointError(f"{source.version} records no base model for its adapters.")
    live = base_fingerprint(model.config, cfg.model.path, cfg.model.init_seed, cfg.model.quant)
    lead = f"the adapters in {source.version} were trained on another base model"
    if fingerprint_differences(saved[BASE], live):
        if not allow_other_base:
            raise refuse_other_base(lead, saved[BASE], live, ALLOW_FLAG)
        log.warning("%s; going on as %s asks", base_mismatch(lead, saved[BASE], live), ALLOW_FLAG)
    apply_lora(model, cfg.lora, seed=cfg.model.init_seed)
    trainable = {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}
    adapters = read_model_tensors(source, module_inventory(trainable))
    model.load_state_dict(adapters, strict=False)
    return model.eval()
