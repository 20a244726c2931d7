"""A model's content hash: the same from memory and from the files it was saved to, however
the files are split, and different for any other value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from veoptim.content_hash import files_content_hash, state_content_hash
from veoptim.errors import ConfigError


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).bfloat16(),
        "layers.0.mlp.weight": torch.randn(32, 16, generator=g),
        "layers.0.norm.weight": torch.ones(16, dtype=torch.float16),
        "step": torch.tensor([3], dtype=torch.int64),
    }


@pytest.mark.parametrize("shard_bytes", [1 << 30, 1024])  # one file, or one tensor per shard
def test_memory_and_files_give_the_same_hash_however_the_files_are_split(
    tmp_path: Path, shard_bytes: int
) -> None:
    state = _state()
    save_torch_state_dict(state, tmp_path, max_shard_size=shard_bytes)
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shard_bytes == 1024)
    assert files_content_hash(tmp_path) == state_content_hash(state)


def test_any_changed_value_name_or_dtype_changes_the_hash() -> None:
    state = _state()
    base = state_content_hash(state)
    assert state_content_hash(_state()) == base
    for edit in (
        lambda s: s["layers.0.mlp.weight"].view(-1)[7].add_(1e-6),
        lambda s: s.update({"embed.weight": s["embed.weight"].float()}),
        lambda s: s.update({"renamed": s.pop("step")}),
    ):
        changed = _state()
        edit(changed)
        assert state_content_hash(changed) != base


def test_a_rewritten_file_is_hashed_again(tmp_path: Path) -> None:
    save_torch_state_dict(_state(0), tmp_path)
    first = files_content_hash(tmp_path)
    save_torch_state_dict(_state(1), tmp_path)  # same shapes, other values
    file = next(tmp_path.glob("*.safetensors"))
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 1))
    assert files_content_hash(tmp_path) == state_content_hash(_state(1)) != first


def test_a_directory_without_weights_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no safetensors weights"):
        files_content_hash(tmp_path)
