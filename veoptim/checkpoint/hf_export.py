"""Hugging Face export: ``model.safetensors`` (sharded with an index above a size), config, tokenizer.

The directory loads with ``AutoModelForCausalLM.from_pretrained`` without any
conversion. This module only fills a directory; callers publish it atomically
through the checkpoint publisher, like every other writer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from veoptim.dtypes import DTYPES
from veoptim.errors import ConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE_PATTERN = "model-{index:05d}-of-{total:05d}.safetensors"
KIND_HF_EXPORT = "hf_export"  # manifest kind: never picked by resume=auto
EXPORT_DTYPES: dict[str, torch.dtype | None] = {**DTYPES, "preserve": None}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the unsharded model state on CPU. Collective: every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def _cast(state: dict[str, torch.Tensor], dtype_name: str) -> dict[str, torch.Tensor]:
    if dtype_name not in EXPORT_DTYPES:
        raise ConfigError(
            f"checkpoint.hf_export.dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype_name!r}."
        )
    dtype = EXPORT_DTYPES[dtype_name]
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in state.items():
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        if (
            tensor.untyped_storage().data_ptr() in seen
        ):  # tied weights: safetensors wants no aliasing
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def write_hf_export(
    state: dict[str, torch.Tensor],
    model_config: Any,
    tokenizer: Any,
    out_dir: Path,
    dtype: str = "bf16",
    max_shard_size_mb: int = 2048,
) -> list[Path]:
    """Write ``state`` (a full state dict) as an HF model directory; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _cast(state, dtype)
    shards = _shards(tensors, max_shard_size_mb * 1024 * 1024)
    written: list[Path] = []
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / SAFETENSORS_FILE), metadata={"format": "pt"})
        written.append(out_dir / SAFETENSORS_FILE)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = SHARD_FILE_PATTERN.format(index=i, total=len(shards))
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            written.append(out_dir / name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2))
        written.append(out_dir / SAFETENSORS_INDEX_FILE)
    config = model_config.__class__.from_dict(model_config.to_dict())
    if EXPORT_DTYPES[dtype] is not None:
        config.dtype = EXPORT_DTYPES[dtype]
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return written
