"""LoRA formats of ``veoptim-export``: the PEFT adapter directory (published like the live
ones, ``adapters.py``) and the merged full model.

A LoRA checkpoint holds the adapters and a fingerprint of the frozen base, not the base.
Offline, the base is rebuilt (from ``model.path``, or from config with ``model.init_seed``),
checked against the fingerprint, and the adapters are read into it from DCP.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from torch import nn

from veoptim.checkpoint import component as C
from veoptim.checkpoint.component import read_json
from veoptim.data import special_token_ids
from veoptim.errors import CheckpointError
from veoptim.export.adapters import base_reference, ensure_base_export, write_adapter_dir
from veoptim.export.hf_format import write_hf_export
from veoptim.export.source import CheckpointSource, read_model_tensors
from veoptim.lora import apply_lora
from veoptim.lora.peft_format import (
    merged_state,
    peft_adapter_state,
)
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


# ------------------------------------------------------------------ offline (the CLI)
def lora_model(source: CheckpointSource, allow_other_base: bool = False) -> nn.Module:
    """The base with real weights, checked against the checkpoint's fingerprint (its
    content too: a base retrained under the same path is refused unless
    ``allow_other_base``), plus the adapters read from DCP."""
    cfg = source.cfg
    special = special_token_ids(source.tokenizer)
    model = build_model(cfg.model, len(source.tokenizer), special)
    saved = read_json(C.shared_json_path(source.version, MODEL))
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


def write_peft(source: CheckpointSource, out_dir: Path, options: Any) -> None:
    """``--format peft``: the adapter directory; a base built from config is exported once
    as ``<out>/hf_base`` beside it (before the adapter is published)."""
    model = lora_model(source, options.allow_other_base)
    root = out_dir.parent.parent  # <root>/.versions/<version>
    export = dataclasses.replace(
        source.cfg.export, dtype=options.dtype, max_shard_size_mb=options.max_shard_size_mb
    )
    cfg = dataclasses.replace(source.cfg, export=export)
    ensure_base_export(
        model, cfg, source.tokenizer, root, step=source.step, fsync=True, run=source.run
    )
    write_adapter_dir(
        out_dir, peft_adapter_state(model), source.cfg, model, base_reference(source.cfg, root),
        source.tokenizer,
    )  # fmt: skip


def write_merged(source: CheckpointSource, out_dir: Path, options: Any) -> None:
    """``--format merged``: the full model with the adapters folded in."""
    model = lora_model(source, options.allow_other_base)
    write_hf_export(merged_state(model), model, source.tokenizer, out_dir, dtype=options.dtype,
                    max_shard_size_mb=options.max_shard_size_mb)  # fmt: skip
