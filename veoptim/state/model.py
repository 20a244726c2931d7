"""A module's weights as a state component (sharded DCP tensors, resharded on load)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from veoptim.checkpoint import (
    ComponentState,
    Inventory,
    SavedComponent,
    Staged,
    TensorSpec,
)
from veoptim.optim.dtensor_util import local

#: Load hooks that an in-place copy makes unnecessary: FSDP2's pre-load hook reshards
#: (the state dict taken at staging already did) and its post-load hook re-registers a
#: parameter that was replaced (a copy replaces nothing).
_INERT_HOOK_MODULES = ("torch.distributed.fsdp._fully_shard.",)


def module_inventory(state: dict[str, torch.Tensor]) -> Inventory:
    """Global specs of a (sharded) model state dict's tensors."""
    return {
        fqn: TensorSpec(tuple(t.shape), t.dtype)
        for fqn, t in state.items()
        if isinstance(t, torch.Tensor)
    }


def _has_load_hooks(model: torch.nn.Module) -> bool:
    """Whether any submodule has a load_state_dict hook that could do more than FSDP2's."""
    for module in model.modules():
        hooks = [*module._load_state_dict_pre_hooks.values()]
        hooks += module._load_state_dict_post_hooks.values()
        for hook in hooks:
            source = getattr(getattr(hook, "hook", hook), "__module__", None) or ""
            if not source.startswith(_INERT_HOOK_MODULES):
                return True
    return False


def copy_installer(
    model: torch.nn.Module, live: dict[str, torch.Tensor], staged: dict[str, torch.Tensor]
) -> Callable[[], None] | None:
    """An install that copies ``staged`` into ``live`` in place, or None where that would
    not be what ``set_model_state_dict`` does.

    ``live`` is a state dict of ``model``; where each of its tensors is a parameter's or a
    persistent buffer's own memory and no load hook needs to run, loading is exactly a copy
    into that memory, without DCP re-deriving every parameter's name on each load (a
    third of a 100 MB load's fixed cost).
    """
    owned = {local(t).data_ptr() for t in (*model.parameters(), *model.buffers())}
    if _has_load_hooks(model) or any(local(t).data_ptr() not in owned for t in live.values()):
        return None
    if any(local(t).shape != local(staged[fqn]).shape for fqn, t in live.items()):
        return None

    @torch.no_grad()
    def install() -> None:
        for fqn, target in live.items():
            local(target).copy_(local(staged[fqn]))

    return install


class ModelState:
    """Parameters and persistent buffers of ``model`` (FSDP2/EP DTensors keep their layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state(self) -> ComponentState:
        return ComponentState(tensors=get_model_state_dict(self.model))

    def stage(self, saved: SavedComponent) -> Staged:
        live = get_model_state_dict(self.model)
        buffers = {fqn: torch.empty_like(t) for fqn, t in live.items()}

        def install_through_dcp() -> None:
            with torch.no_grad():
                set_model_state_dict(self.model, buffers)

        install = copy_installer(self.model, live, buffers) or install_through_dcp
        return Staged(expected=module_inventory(live), buffers=buffers, install=install)
