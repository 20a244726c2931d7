"""LoRA exports: the PEFT adapter directory (with its base exported once beside it) and the
merged full model; used by the end-of-run callback and by ``veoptim-export`` alike.

A LoRA checkpoint holds the adapters and a fingerprint of the frozen base, not the base.
Offline, the base is rebuilt (from ``model.path``, or from config with ``model.init_seed``),
checked against the fingerprint, and the adapters are read into it from DCP.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veoptim.checkpoint import contents as C
from veoptim.checkpoint.hf_export import KIND_HF_EXPORT, make_readable, write_hf_export
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.resolve import read_link
from veoptim.checkpoint.validate import read_json
from veoptim.config.schema import TrainerConfig
from veoptim.data import special_token_ids
from veoptim.errors import CheckpointError
from veoptim.export.source import CheckpointSource, read_model_tensors
from veoptim.lora import apply_lora
from veoptim.lora.peft_format import (
    BASE_FINGERPRINT_FILE,
    adapter_config,
    base_state,
    merged_state,
    peft_adapter_state,
    write_peft_adapter,
)
from veoptim.lora.state import BASE, base_fingerprint
from veoptim.models import build_model
from veoptim.state import MODEL
from veoptim.state.model import module_inventory

#: The base model exported once beside the adapters of a run whose base was built from config.
BASE_EXPORT = "hf_base"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseReference:
    """What an adapter's ``adapter_config.json`` names as its base."""

    name_or_path: str  # base_model_name_or_path
    revision: str | None = None  # PEFT's ``revision`` of a Hub base


def base_reference(cfg: TrainerConfig, exports_root: Path) -> BaseReference:
    """The one place that decides ``base_model_name_or_path``: a path that stays valid as
    long as the base is published, never the version directory behind a name.

    ``model.path`` as the user gave it, made absolute but with its symlinks kept (an export's
    name ``<run>/exports/hf_final`` is a link to ``.versions/hf_final.<token>``, which
    retention deletes once the base is published again); a base built from config is the
    ``hf_base`` link beside the adapters.
    A Hub model is named by its id and the commit it resolved to (PEFT's ``revision``), so
    ``from_pretrained`` finds it in any Hub cache, or downloads it.
    """
    if cfg.model.hub_id:
        return BaseReference(cfg.model.hub_id, cfg.model.revision or None)
    if cfg.model.path:
        return BaseReference(os.path.abspath(cfg.model.path))
    return BaseReference(os.path.abspath(exports_root / BASE_EXPORT))


def needs_base_export(cfg: TrainerConfig, exports_root: Path, model: nn.Module) -> bool:
    """A base built from config has no directory: export it once, and again when
    ``hf_base`` holds another base (a reused run dir, say) — rank 0 looks."""
    if cfg.model.path:
        return False
    if read_link(exports_root, BASE_EXPORT) is None:
        return True
    marker = exports_root / BASE_EXPORT / BASE_FINGERPRINT_FILE
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        found = None
    if found == exported_base_fingerprint(cfg, model):
        return False
    log.warning(
        "%s holds another base model than this run's (%s); publishing this run's base there "
        "(adapters exported earlier name the path, which now holds the new base).",
        exports_root / BASE_EXPORT, marker.name,
    )  # fmt: skip
    return True


def exported_base_fingerprint(cfg: TrainerConfig, model: nn.Module) -> dict[str, Any]:
    """What identifies a base built from config: its config and ``model.init_seed``."""
    return base_fingerprint(model.config, cfg.model.path, cfg.model.init_seed)


def publish_base(
    state: dict[str, torch.Tensor], model: nn.Module, tokenizer: Any, root: Path, *,
    cfg: TrainerConfig, step: int, dtype: str, max_shard_size_mb: int, fsync: bool,
    is_main: bool = True,
) -> None:  # fmt: skip
    """Publish the frozen base (``state`` with the base's own key names) as ``hf_base``,
    with its fingerprint (``veoptim_base.json``) to recognise it later."""
    with Publisher(root, fsync=fsync).write(BASE_EXPORT, kind=KIND_HF_EXPORT, step=step,
                                            prunable=False) as out:  # fmt: skip
        if is_main:
            write_hf_export(
                state, model, tokenizer, out, dtype=dtype, max_shard_size_mb=max_shard_size_mb
            )
            fingerprint = exported_base_fingerprint(cfg, model)
            (out / BASE_FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=1) + "\n")


def write_adapter_dir(
    out: Path,
    adapter: dict[str, torch.Tensor],
    cfg: TrainerConfig,
    model: nn.Module,
    base: BaseReference,
) -> None:
    """The PEFT adapter directory of ``model``'s adapters (rank 0), with the base's
    fingerprint (``veoptim_base.json``) so a later load can tell whether the base that
    ``base_model_name_or_path`` names is still the one the adapters were trained on."""
    config = adapter_config(cfg.lora, model, base.name_or_path)
    if base.revision:
        config["revision"] = base.revision
    write_peft_adapter(out, adapter, config)
    fingerprint = exported_base_fingerprint(cfg, model)
    (out / BASE_FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=1) + "\n")
    make_readable(out)


# ------------------------------------------------------------------ offline (the CLI)
def lora_model(source: CheckpointSource) -> nn.Module:
    """The base with real weights, checked against the checkpoint's fingerprint, plus the
    adapters read from DCP."""
    cfg = source.cfg
    special = special_token_ids(source.tokenizer)
    model = build_model(cfg.model, len(source.tokenizer), special)
    saved = read_json(C.shared_json_path(source.version, MODEL))
    live = base_fingerprint(model.config, cfg.model.path, cfg.model.init_seed)
    if not isinstance(saved, dict) or saved.get(BASE) != live:
        raise CheckpointError(
            f"the base rebuilt for {source.version} does not match the one its adapters were "
            f"trained on (saved {saved.get(BASE) if isinstance(saved, dict) else saved}, rebuilt "
            f"{live}); is model.path still the same model?"
        )
    apply_lora(model, cfg.lora, seed=cfg.model.init_seed)
    trainable = {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}
    adapters = read_model_tensors(source, module_inventory(trainable))
    model.load_state_dict(adapters, strict=False)
    return model.eval()


def write_peft(source: CheckpointSource, out_dir: Path, options: Any) -> None:
    """``--format peft``: the adapter directory; a base built from config is exported once
    as ``<out>/hf_base`` beside it (before the adapter is published)."""
    model = lora_model(source)
    root = out_dir.parent.parent  # <root>/.versions/<version>
    if needs_base_export(source.cfg, root, model):
        publish_base(base_state(model), model, source.tokenizer, root, cfg=source.cfg, step=source.step,
                     dtype=options.dtype, max_shard_size_mb=options.max_shard_size_mb,
                     fsync=True)  # fmt: skip
    write_adapter_dir(
        out_dir, peft_adapter_state(model), source.cfg, model, base_reference(source.cfg, root)
    )


def write_merged(source: CheckpointSource, out_dir: Path, options: Any) -> None:
    """``--format merged``: the full model with the adapters folded in."""
    model = lora_model(source)
    write_hf_export(merged_state(model), model, source.tokenizer, out_dir, dtype=options.dtype,
                    max_shard_size_mb=options.max_shard_size_mb)  # fmt: skip
