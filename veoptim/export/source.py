"""A training checkpoint opened for export, without a training job.

The model is rebuilt *on meta* from the checkpoint's own ``config`` component state, so
it costs no memory; the weights are read from DCP into fresh, unsharded CPU buffers
(DCP reshards from any world size or expert-parallel layout). The host therefore holds
one full model in the checkpoint's dtype, which the HF writer casts tensor by tensor.
Bad input (a run directory, a checkpoint root, an unfinished version, an export) fails
with one ``CheckpointError`` line that says what to pass instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from veoptim.checkpoint import (
    INFO_FILE,
    VERSIONS_DIR,
    Checkpointer,
    Inventory,
    latest_complete,
    locate_path,
    manifest_path,
    shared_json_path,
)
from veoptim.config.schema import TrainerConfig
from veoptim.data import load_tokenizer, special_token_ids
from veoptim.errors import CheckpointError
from veoptim.models import build_model
from veoptim.state import CONFIG, MODEL
from veoptim.state.model import module_inventory

#: Substrings of the model keys of LoRA adapter weights (PEFT's naming).
LORA_KEY_MARKERS = (".lora_A.", ".lora_B.")


@dataclass
class CheckpointSource:
    """What an export writer needs: the version, its config, tokenizer and model (meta)."""

    version: Path  # the resolved, complete version directory
    cfg: TrainerConfig
    tokenizer: Any
    model: torch.nn.Module  # built on meta: structure, config and tied keys, no storage
    step: int
    saved: Inventory  # the model tensors stored in DCP (keys without "model.")
    run: str | None = None  # the run that published it (its exports record the same)

    @property
    def has_lora(self) -> bool:
        """Whether the checkpoint holds LoRA adapter weights."""
        return any(marker in key for key in self.saved for marker in LORA_KEY_MARKERS)


def _refuse_non_checkpoint(path: Path) -> None:
    """One line saying what was passed and what to pass instead."""
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path} does not exist; pass a training checkpoint directory.")
    if path.is_dir() and not path.is_symlink():
        if path.parent.name == VERSIONS_DIR and not manifest_path(path).is_file():
            raise CheckpointError(
                f"{path} is an incomplete checkpoint version (no manifest.json: its save never "
                "finished); pass a published checkpoint name such as <root>/step_..."
            )
        if (path / INFO_FILE).is_file():
            return
        if (path / "checkpoints").is_dir():
            newest = latest_complete(path / "checkpoints")
            example = f"{path}/checkpoints/{newest or 'step_...'}"
            raise CheckpointError(
                f"{path} is a run directory, not a checkpoint; pass {example} "
                "(a checkpoint name or version directory inside <run>/checkpoints)."
            )
        if (path / VERSIONS_DIR).is_dir():
            newest = latest_complete(path)
            raise CheckpointError(
                f"{path} is a checkpoint root, not a checkpoint; pass one of its names, "
                f"e.g. {path}/{newest or 'step_...'}."
            )
        if (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} is a Hugging Face model directory, not a training checkpoint."
            )


def _known_keys(saved: dict[str, Any], schema: DictConfig) -> dict[str, Any]:
    """``saved`` without the keys this schema lacks (sections of a task or an older
    release): only what every task shares is needed to rebuild the model."""
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key not in schema:
            continue
        node = schema[key]
        out[key] = _known_keys(value, node) if isinstance(value, dict) and isinstance(node, DictConfig) else value  # fmt: skip
    return out


def _saved_config(version: Path, saved: Any) -> TrainerConfig:
    try:
        base = OmegaConf.structured(TrainerConfig)
        return OmegaConf.to_object(OmegaConf.merge(base, _known_keys(saved, base)))
    except Exception as exc:
        path = shared_json_path(version, CONFIG)
        raise CheckpointError(f"{path} is not a valid run config: {exc}.") from exc


def open_checkpoint(checkpoint: str | Path) -> CheckpointSource:
    """Validate ``checkpoint`` (a name link, version or legacy directory) and rebuild its
    model on meta; no tensor is read yet (``Checkpointer.read`` checks the version and
    reads its config and tensor inventory)."""
    path = Path(checkpoint).expanduser()
    _refuse_non_checkpoint(path)
    resolved = locate_path(path)  # its manifest read and verified once
    _refuse_non_checkpoint(resolved.path)  # a name may point to an export
    opened = _reader(resolved.path).read(resolved, json=(CONFIG,), needs=(MODEL,))
    cfg = _saved_config(resolved.path, opened.json[CONFIG])
    tokenizer = load_tokenizer(
        cfg.data.tokenizer_path, model_path=cfg.model.path, chat_template=cfg.data.chat_template
    )
    special = special_token_ids(tokenizer)
    model = build_model(cfg.model, len(tokenizer), special, on_meta=True)
    return CheckpointSource(
        resolved.path, cfg, tokenizer, model, opened.info.step, opened.saved[MODEL], resolved.run
    )


def _reader(version: Path) -> Checkpointer:
    """A checkpointer to read ``version`` with (it never writes)."""
    return Checkpointer(version.parent, fsync=False)


def model_inventory(source: CheckpointSource) -> Inventory:
    """The tensors the rebuilt model has (what a full fine-tune's checkpoint stores)."""
    return module_inventory(source.model.state_dict())


def read_model_tensors(source: CheckpointSource, expected: Inventory) -> dict[str, torch.Tensor]:
    """Read exactly the ``expected`` model tensors (after the inventory check a resume
    does) into fresh CPU buffers; the caller owns the only references."""
    return _reader(source.version).read(source.version, {MODEL: expected}).tensors[MODEL]
