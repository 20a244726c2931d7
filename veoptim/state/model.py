"""A module's weights as a state component (sharded DCP tensors, resharded on load)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from veoptim.checkpoint.component import (
    ComponentState,
    Inventory,
    SavedComponent,
    Staged,
    TensorSpec,
)


def module_inventory(state: dict[str, torch.Tensor]) -> Inventory:
    """Global specs of a (sharded) model state dict's tensors."""
    return {
        fqn: TensorSpec(tuple(t.shape), t.dtype)
        for fqn, t in state.items()
        if isinstance(t, torch.Tensor)
    }


class ModelState:
    """Parameters and persistent buffers of ``model`` (FSDP2/EP DTensors keep their layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state(self) -> ComponentState:
        return ComponentState(tensors=get_model_state_dict(self.model))

    def stage(self, saved: SavedComponent) -> Staged:
        live = get_model_state_dict(self.model)
        buffers = {fqn: torch.empty_like(t) for fqn, t in live.items()}

        def install() -> None:
            with torch.no_grad():
                set_model_state_dict(self.model, buffers)

        return Staged(expected=module_inventory(live), buffers=buffers, install=install)
