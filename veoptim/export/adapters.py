"""The PEFT adapter directory and its base: the pieces of the registry's ``peft`` format
(``formats.write_peft``), which the end-of-run callback, the multi-LoRA slots and
``veoptim-export --format peft`` all publish through.

An adapter names its base in ``adapter_config.json`` (``base_model_name_or_path``) by a
path that stays valid as long as the base is published; a base built from config has no
such path, so it is published once as ``hf_base`` beside the adapters (and again when that
holds another base), with a fingerprint that a later load checks.
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

from veoptim.checkpoint import Publisher, read_link
from veoptim.config.schema import TrainerConfig
from veoptim.distributed.agreement import on_rank0
from veoptim.export.hf_format import KIND_HF_EXPORT, make_readable, write_hf_export
from veoptim.lora.peft_format import (
    BASE_FINGERPRINT_FILE,
    adapter_config,
    base_state,
    write_peft_adapter,
)
from veoptim.lora.state import base_fingerprint

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
    return base_fingerprint(model.config, cfg.model.path, cfg.model.init_seed, cfg.model.quant)


def publish_base(
    state: dict[str, torch.Tensor], model: nn.Module, tokenizer: Any, root: Path, *,
    cfg: TrainerConfig, step: int, dtype: str, max_shard_size_mb: int, fsync: bool,
    is_main: bool = True, run: str | None = None,
) -> None:  # fmt: skip
    """Publish the frozen base (``state`` with the base's own key names) as ``hf_base``,
    with its fingerprint (``veoptim_base.json``) to recognise it later; ``run``: the run
    id its manifest records."""
    with Publisher(root, fsync=fsync, run=run).write(BASE_EXPORT, kind=KIND_HF_EXPORT, step=step,
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
    tokenizer: Any = None,
) -> None:
    """The PEFT adapter directory of ``model``'s adapters (rank 0), with the base's
    fingerprint (``veoptim_base.json``) so a later load can tell whether the base that
    ``base_model_name_or_path`` names is still the one the adapters were trained on. A run
    with its own ``data.chat_template`` saves ``tokenizer`` there too: the base's tokenizer
    has another template (``veoptim-generate`` prefers the adapter's tokenizer)."""
    config = adapter_config(cfg.lora, model, base.name_or_path)
    if base.revision:
        config["revision"] = base.revision
    write_peft_adapter(out, adapter, config)
    fingerprint = exported_base_fingerprint(cfg, model)
    (out / BASE_FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=1) + "\n")
    if tokenizer is not None and cfg.data.chat_template:
        tokenizer.save_pretrained(out)
    make_readable(out)


def ensure_base_export(
    model: nn.Module, cfg: TrainerConfig, tokenizer: Any, exports_root: Path, *, step: int,
    fsync: bool, is_main: bool = True, run: str | None = None,
) -> None:  # fmt: skip
    """Publish the base as ``<exports_root>/hf_base`` if the adapters need it there (rank 0
    decides, agreed; the base is gathered on every rank). Collective."""
    if on_rank0(
        lambda: needs_base_export(cfg, exports_root, model),
        f"checking the base export in {exports_root}",
    ):
        publish_base(base_state(model), model, tokenizer, exports_root, cfg=cfg, step=step,
                     dtype=cfg.export.dtype, max_shard_size_mb=cfg.export.max_shard_size_mb,
                     fsync=fsync, is_main=is_main, run=run)  # fmt: skip
        log.info("exported the frozen base model to %s", exports_root / BASE_EXPORT)
