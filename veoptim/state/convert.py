"""Offline conversion: a training checkpoint's model weights → a Hugging Face directory.

Runs in one process without a training job: the model is rebuilt from the
checkpoint's own config state, its weights are read from DCP (any world size
or EP layout: DCP reshards to the unsharded model) after the same inventory
validation a resume uses, and the export is published atomically.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import DefaultLoadPlanner

from veoptim.checkpoint import contents as C
from veoptim.checkpoint.hf_export import KIND_HF_EXPORT, write_hf_export
from veoptim.checkpoint.inventory import compare_inventory, saved_inventory
from veoptim.checkpoint.publish import Published, Publisher
from veoptim.checkpoint.resolve import resolve_path
from veoptim.checkpoint.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.validate import check_components, check_info, read_json
from veoptim.config.schema import TrainerConfig
from veoptim.data import load_tokenizer
from veoptim.errors import CheckpointError
from veoptim.models import build_model
from veoptim.state import CONFIG, MODEL
from veoptim.state.model import module_inventory


def load_checkpoint_model(checkpoint: str | Path):
    """(model, tokenizer, step) of a training checkpoint, weights loaded and validated."""
    version = resolve_path(Path(checkpoint))
    info = check_info(read_json(version / C.INFO_FILE), version)
    check_components(info[C.INFO_COMPONENTS], (MODEL, CONFIG), version, exact=False)
    config_file = C.shared_json_path(version, CONFIG)
    saved = read_json(config_file)
    try:
        # Only the sections every task shares are needed to rebuild the model.
        base = OmegaConf.structured(TrainerConfig)
        shared = {k: v for k, v in saved.items() if k in base}
        shared["data"] = {k: v for k, v in saved.get("data", {}).items() if k in base.data}
        cfg: TrainerConfig = OmegaConf.to_object(OmegaConf.merge(base, shared))
    except Exception as exc:
        raise CheckpointError(f"{config_file} is not a valid run config: {exc}.") from exc
    tokenizer = load_tokenizer(cfg.data.tokenizer_path, model_path=cfg.model.path)
    special = {
        key: getattr(tokenizer, key)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id")
        if getattr(tokenizer, key, None) is not None
    }
    model = build_model(cfg.model, len(tokenizer), special)
    state = model.state_dict()
    dcp_dir = version / C.DCP_DIR
    saved_tensors = saved_inventory(read_dcp_metadata(dcp_dir), MODEL, dcp_dir)
    compare_inventory(module_inventory(state), saved_tensors, dcp_dir)
    staged = {MODEL: state}
    dcp.load(
        staged,
        storage_reader=SafeFileSystemReader(dcp_dir),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    model.load_state_dict(staged[MODEL])
    return model, tokenizer, int(info[C.INFO_STEP])


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
