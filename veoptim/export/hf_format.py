"""Hugging Face export: safetensors weights (sharded with an index above a size), config,
generation config and tokenizer, all world-readable.

The directory loads with ``AutoModelForCausalLM.from_pretrained`` without any
conversion. This module only fills a directory; callers publish it atomically
through the checkpoint publisher, like every other writer. The live export
(``callbacks/hf_export.py``) and the offline one (``veoptim-export``) both reach it through
the registry's ``hf`` writer (``formats.write_hf``) with the same inputs, so they write the
same bytes.

Weights go through ``huggingface_hub.save_torch_state_dict``: it plans the shards
(``max_shard_size`` in bytes; a tensor larger than that gets a shard of its own), writes
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` plus the index into the
directory we give it, and drops aliased tensors by name (``shared_tensors_to_discard``:
we pass the model's tied keys, as ``transformers`` does, and alias them first, because a
dtype cast or a DCP read unties them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig

from veoptim.content_hash import state_content_hash
from veoptim.dtypes import torch_dtypes
from veoptim.errors import ConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: The export's own record: the content hash of its weights (``veoptim.content_hash``), so a
#: LoRA run on it, and every adapter trained there, can name the bytes they belong to.
MODEL_RECORD_FILE = "veoptim_model.json"
KIND_HF_EXPORT = "hf_export"  # manifest kind: never picked by resume=auto
EXPORT_DTYPES: dict[str, torch.dtype | None] = {**torch_dtypes(), "preserve": None}
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the unsharded model state on CPU. Collective: every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def tied_weight_keys(model: torch.nn.Module) -> dict[str, str]:
    """``{tied key: the key it shares}`` of a ``transformers`` model (empty when untied)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {str(target): str(source) for target, source in dict(tied).items()}


def architecture_name(model: torch.nn.Module) -> str:
    """The ``transformers`` class of ``model`` (FSDP2 wraps it in a generated subclass)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__


def export_dtype(name: str) -> torch.dtype | None:
    """The dtype of ``export.dtype`` (None = keep each tensor's own)."""
    if name not in EXPORT_DTYPES:
        raise ConfigError(f"export.dtype must be one of {sorted(EXPORT_DTYPES)}, got {name!r}.")
    return EXPORT_DTYPES[name]


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast tensor by tensor, popping each source from ``state``: the host then holds about
    one full model (the source, shrinking, plus the casts), never two."""
    out: dict[str, torch.Tensor] = {}
    for key in list(state):
        tensor = state.pop(key)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.contiguous()
        del tensor
    return out


def _alias_tied(tensors: dict[str, torch.Tensor], tied: Mapping[str, str]) -> list[str]:
    """Point each tied key at the tensor it shares (equal values only); return those keys."""
    aliased = []
    for target, source in tied.items():
        a, b = tensors.get(target), tensors.get(source)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.data_ptr() == b.data_ptr() or torch.equal(a, b):
            tensors[target] = b
            aliased.append(target)
    return aliased


def generation_config(model_config: Any, tokenizer: Any) -> GenerationConfig:
    """The model's generation defaults, with the tokenizer's special token ids."""
    config = GenerationConfig.from_model_config(model_config)
    for key in _SPECIAL_IDS:
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(config, key, value)
    return config


def _umask() -> int:
    """The process umask, read without changing it (other threads may be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: the classic read, briefly setting a common value
    os.umask(mask)
    return mask


def make_readable(out_dir: Path) -> None:
    """Give every file the mode a plain ``open`` would (0644 under umask 022): the
    safetensors writer creates a 0600 temporary file and renames it into place."""
    mode = 0o666 & ~_umask()
    for path in sorted(out_dir.rglob("*")):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def save_hashed(
    tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int, discard: list[str]
) -> str:
    """Write ``tensors`` (but ``discard``) as safetensors shards and return their content
    hash, computed while the writer writes: the bytes are in memory, and hashing overlaps
    the I/O instead of adding to it."""
    written = {k: v for k, v in tensors.items() if k not in discard}
    with ThreadPoolExecutor(1) as pool:
        content = pool.submit(state_content_hash, written)
        save_torch_state_dict(
            tensors, out_dir, max_shard_size=max_shard_size, shared_tensors_to_discard=discard
        )
        return content.result()


def write_hf_export(
    state: dict[str, torch.Tensor],
    model: torch.nn.Module,
    tokenizer: Any,
    out_dir: Path,
    dtype: str = "bf16",
    max_shard_size_mb: int = 2048,
) -> list[Path]:
    """Write ``state`` (a full state dict of ``model``) as an HF model directory.

    ``state`` is consumed (emptied) so the host never holds two copies of the model;
    ``model`` (live, sharded or on meta) supplies the config, class name and tied keys.
    Returns the files written.
    """
    target = export_dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _cast(state, target)
    discard = _alias_tied(tensors, tied_weight_keys(model))
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    record = {"content": save_hashed(tensors, out_dir, max_shard_size_mb * 1024 * 1024, discard)}
    del tensors
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [architecture_name(model)]
    if target is not None or floating:
        config.dtype = target if target is not None else floating[0]
    config.save_pretrained(out_dir)
    generation_config(config, tokenizer).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MODEL_RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    make_readable(out_dir)
    return sorted(p for p in out_dir.rglob("*") if p.is_file())
