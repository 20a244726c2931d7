"""Fresh buffers that a load reads into, shaped like the live optimizer's state (never the live state)."""

from __future__ import annotations

from typing import Any

import torch

from veoptim.checkpoint.inventory import trainable_named_params
from veoptim.optim.dtensor_util import local, wrap_like
from veoptim.optim.state_check import expected_optimizer_state


def _state_device(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.device:
    """Where the optimizer keeps ``param``'s state (host memory for offloaded groups)."""
    placement = getattr(optimizer, "state_device", None)
    if placement is None:
        return local(param).device
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    return placement(param, group)


def optimizer_staging(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, dict[str, torch.Tensor]]:
    """``{fqn: {state key: empty tensor}}`` with the expected dtype, local shape and sharding.

    Tensors shaped like the parameter's local shard are wrapped as DTensors with the
    parameter's layout, so DCP reads exactly this rank's shard (resharding if needed).
    """
    staging: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, param in trainable_named_params(model, optimizer):
        device = _state_device(optimizer, param)
        entry = {}
        for key, (shape, dtype) in expected_optimizer_state(optimizer, param).items():
            buffer = torch.empty(shape, dtype=dtype, device=device)
            if tuple(shape) == tuple(local(param).shape):
                buffer = wrap_like(param, buffer)
            entry[key] = buffer
        staging[fqn] = entry
    return staging


def to_json_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param-group hyperparameters as JSON values (tuples → lists, 0-d tensors → floats)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item()
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    return [{k: plain(v) for k, v in group.items()} for group in groups]
