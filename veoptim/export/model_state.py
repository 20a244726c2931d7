"""What every model writer of the export registry gets: a model with its weights, the
run's config and tokenizer, and where the export is published (``registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veoptim.config.schema import TrainerConfig
from veoptim.export.hf_format import full_model_state


@dataclass(frozen=True)
class ExportOptions:
    """How to write: the ``export.*`` settings (``veoptim-export`` takes them as flags)."""

    dtype: str = "bf16"  # bf16 | fp32 | preserve
    max_shard_size_mb: int = 2048
    allow_other_base: bool = False  # peft/merged: a base whose content differs is accepted


@dataclass
class ModelState:
    """A model ready to export, live (the training model, maybe sharded) or rebuilt from a
    checkpoint (``registry.checkpoint_state``). Writers read it; they never look around
    ``out_dir`` for context: everything they need is here."""

    model: nn.Module  # live, or on CPU; on meta when ``weights`` holds the full state
    cfg: TrainerConfig
    tokenizer: Any
    step: int
    exports_root: Path  # the root the adapters' base (``hf_base``) is published in
    run: str | None = None  # the run id the manifests record
    origin: str = ""  # what a refusal names: the checkpoint version or the run directory
    lora: bool = False  # the model carries LoRA adapters
    is_main: bool = True  # rank 0 writes files; every rank calls the writer (collectives)
    fsync: bool = True
    weights: dict[str, torch.Tensor] | None = None  # the full state, already read (offline)
    adapter: dict[str, torch.Tensor] | None = None  # PEFT-named, gathered (a slot's own)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded model state on CPU, handed over once (the writer consumes it):
        the tensors read from the checkpoint, or gathered from the model (collective)."""
        if self.weights is not None:
            weights, self.weights = self.weights, None
            return weights
        return full_model_state(self.model)


#: A model writer fills ``out_dir`` (an unpublished version directory) from the state.
Writer = Callable[[ModelState, Path, ExportOptions], None]
