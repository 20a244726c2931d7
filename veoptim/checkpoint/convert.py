"""Offline conversion: a training checkpoint's model weights → a Hugging Face directory.

Runs in one process without a training job: the model is rebuilt from the
checkpoint's own ``config.yaml``, its weights are read from DCP (any world size
or EP layout: DCP reshards to the unsharded model) after the same inventory
validation a resume uses, and the export is published atomically.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import OmegaConf
from torch.distributed.checkpoint import DefaultLoadPlanner

from veoptim.checkpoint import format as F
from veoptim.checkpoint.hf_export import KIND_HF_EXPORT, write_hf_export
from veoptim.checkpoint.inventory import compare_inventory, model_inventory
from veoptim.checkpoint.publish import Published, Publisher
from veoptim.checkpoint.resolve import resolve_path
from veoptim.checkpoint.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.validate import check_info, read_json
from veoptim.config.schema import SFTConfig
from veoptim.data import load_tokenizer
from veoptim.errors import CheckpointError
from veoptim.models import build_model


def load_checkpoint_model(checkpoint: str | Path):
    """(model, tokenizer, step) of a training checkpoint, weights loaded and validated."""
    version = resolve_path(Path(checkpoint))
    info = read_json(version / F.INFO_FILE)
    check_info(info, version, load_optimizer=False)
    try:
        saved = yaml.safe_load((version / F.CONFIG_FILE).read_text())
        cfg: SFTConfig = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(SFTConfig), saved)
        )
    except Exception as exc:
        raise CheckpointError(
            f"{version / F.CONFIG_FILE} is not a valid run config: {exc}."
        ) from exc
    tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    special = {
        key: getattr(tokenizer, key)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id")
        if getattr(tokenizer, key, None) is not None
    }
    model = build_model(cfg.model, len(tokenizer), special)
    state = model.state_dict()
    metadata = read_dcp_metadata(version / F.DCP_DIR)
    compare_inventory(model_inventory(state), metadata, (F.MODEL_PREFIX,), version / F.DCP_DIR)
    staged = {F.MODEL_PREFIX: state}
    dcp.load(
        staged,
        storage_reader=SafeFileSystemReader(version / F.DCP_DIR),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    model.load_state_dict(staged[F.MODEL_PREFIX])
    return model, tokenizer, int(info[F.INFO_STEP])


def convert_to_hf(
    checkpoint: str | Path,
    out_root: str | Path,
    name: str,
    *,
    dtype: str = "bf16",
    max_shard_size_mb: int = 2048,
    fsync: bool = True,
) -> Published:
    """Publish ``<out_root>/<name>`` as an HF model directory of ``checkpoint``'s weights."""
    model, tokenizer, step = load_checkpoint_model(checkpoint)
    pending = Publisher(out_root, fsync=fsync).begin(
        name, kind=KIND_HF_EXPORT, step=step, prunable=False
    )
    try:
        write_hf_export(
            model.state_dict(), model.config, tokenizer, pending.path,
            dtype=dtype, max_shard_size_mb=max_shard_size_mb,
        )  # fmt: skip
    except Exception as exc:
        pending.finish(exc)  # raises the CheckpointError; nothing is published
    return pending.finish(None)
