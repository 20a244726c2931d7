"""The optimizers' checks, run before anything is mutated: their arguments, and a loaded
state dict against what the live optimizer expects.

Arguments: optimizers are also built directly (tests, notebooks, other entry points), not
only from a validated config, so each class checks its own arguments: a string
``"false"`` for a boolean option must be an error, not a truthy value.

Loaded state: every check runs before anything is installed, so a rejected state dict leaves
the optimizer (and the model) untouched. Nothing is ever cast: a dtype or shape
that differs from the expectation is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from veoptim.dtypes import WIDE_RANGE_DTYPE_NAMES, torch_dtypes
from veoptim.errors import CheckpointError, ConfigError
from veoptim.optim.dtensor_util import local

#: torch.optim.AdamW's message for a tensor learning rate with more than one element.
TENSOR_LR_MESSAGE = "Tensor lr must be 1-element"


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """A boolean option must be a real ``bool`` (``None`` too where ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ConfigError(
            f"optimizer option {name!r} must be a bool, got {value!r} ({type(value).__name__})."
        )


def check_number(name: str, value: Any) -> float:
    """A real number (not a bool, not a string); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"optimizer option {name!r} must be a number, got {value!r}.")
    return float(value)


def check_lr(lr: Any) -> float:
    """A float or a 1-element tensor (torch's message otherwise), >= 0; returns it as a float."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(TENSOR_LR_MESSAGE)
        value = float(lr)
    else:
        value = check_number("lr", lr)
    if not value >= 0.0:
        raise ConfigError(f"Invalid learning rate: {lr} (AdamW needs lr >= 0).")
    return value


def check_hyper(group: Mapping[str, Any]) -> None:
    """lr, betas, eps, weight_decay and maximize of one param group (or of the defaults)."""
    check_lr(group["lr"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"optimizer option 'betas' must be two numbers, got {betas!r}.")
    for i, b in enumerate(betas):
        if not 0.0 <= check_number(f"betas[{i}]", b) < 1.0:
            raise ConfigError(f"Invalid beta parameter at index {i}: {b} (needs 0 <= beta < 1).")
    if not check_number("eps", group["eps"]) > 0.0:
        raise ConfigError(f"Invalid epsilon value: {group['eps']} (needs eps > 0).")
    if not check_number("weight_decay", group["weight_decay"]) >= 0.0:
        raise ConfigError(f"Invalid weight_decay value: {group['weight_decay']} (needs >= 0).")
    check_bool("maximize", group["maximize"])


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"optimizer option {name!r} must be a positive int, got {value!r}.")


def check_positive_finite(name: str, value: Any) -> None:
    """A number in (0, inf): a divisor of every gradient."""
    if not 0.0 < check_number(name, value) < math.inf:
        raise ConfigError(f"optimizer option {name!r} must be positive and finite, got {value!r}.")


def check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"optimizer option {name!r} must be an int, got {value!r}.")


def check_moment_dtype(name: str, value: Any) -> None:
    """Moment dtypes come from the config dtype table (veoptim/dtypes.py), FP16 left out:
    ``exp_avg_sq`` leaves its range."""
    allowed = [torch_dtypes()[n] for n in WIDE_RANGE_DTYPE_NAMES]
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise ConfigError(
            f"optimizer option {name!r} must be one of {[str(d) for d in allowed]}, got {value!r}."
        )


# ---------------------------------------------------------------- loaded state
#: What an optimizer expects for one parameter: state key -> (local shape, dtype).
ExpectedState = dict[str, tuple[torch.Size, torch.dtype]]


def expected_optimizer_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> ExpectedState:
    """State keys, local shapes and dtypes ``optimizer`` keeps for ``param`` (all four types)."""
    fn = getattr(optimizer, "expected_state", None)
    if fn is None:
        raise TypeError(
            f"expected_optimizer_state supports the veoptim optimizers; got {type(optimizer).__name__}."
        )
    return fn(param)


def check_groups(live: list[dict], saved: Any) -> None:
    """The saved param groups must match the live ones in number and size."""
    if not isinstance(saved, list) or len(saved) != len(live):
        found = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise CheckpointError(
            f"Optimizer state has {found} param groups; the live optimizer has {len(live)}."
        )
    for i, (g, s) in enumerate(zip(live, saved, strict=True)):
        if not isinstance(s, Mapping) or len(s.get("params", ())) != len(g["params"]):
            n = len(s.get("params", ())) if isinstance(s, Mapping) else "?"
            raise CheckpointError(
                f"Optimizer param group {i} has {n} parameters in the state dict; "
                f"the live group has {len(g['params'])}."
            )


def check_entry(name: str, param: torch.Tensor, entry: Any, expected: ExpectedState) -> None:
    """Raise CheckpointError unless ``entry`` holds exactly the expected tensors."""
    if not isinstance(entry, Mapping):
        raise CheckpointError(
            f"Optimizer state of {name} must be a dict of tensors, found {type(entry).__name__}."
        )
    missing = sorted(set(expected) - set(entry))
    extra = sorted(set(entry) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"Optimizer state of {name} must have keys {sorted(expected)}; "
            f"missing {missing}, unexpected {extra}."
        )
    for key, (shape, dtype) in expected.items():
        value = entry[key]
        where = f"optimizer state {key!r} of {name}"
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where} must be a tensor, found {type(value).__name__}.")
        if value.dtype != dtype:
            raise CheckpointError(
                f"{where} must be {dtype}, found {value.dtype}; state is never cast on load."
            )
        if isinstance(value, DTensor):
            if not isinstance(param, DTensor) or key == "step":
                raise CheckpointError(f"{where} is a DTensor but the parameter's state is local.")
            if value.shape != param.shape or tuple(value.placements) != tuple(param.placements):
                raise CheckpointError(
                    f"{where} has global shape {tuple(value.shape)} and placements "
                    f"{value.placements}; expected {tuple(param.shape)} and {param.placements}."
                )
        if local(value).shape != shape:
            raise CheckpointError(
                f"{where} has local shape {tuple(local(value).shape)}, expected {tuple(shape)}."
            )


def param_name(names: Mapping[int, str], param: torch.Tensor, group: int, index: int) -> str:
    """A readable name for error messages: the model FQN when known."""
    return names.get(id(param), f"param {index} of group {group}")


def check_unstepped(name: str, param: torch.Tensor, entry: Mapping[str, Any]) -> None:
    """State whose ``step`` is 0 must be what a fresh optimizer would hold for the live parameter.

    Moments zero and, where there is one, a master equal to the live parameter.
    Such state used to be re-derived silently at the first step; a conflict means
    the state belongs to other weights, so it is refused (CheckpointError).
    """
    if float(entry["step"]) != 0.0:
        return
    for key in ("exp_avg", "exp_avg_sq"):
        value = local(entry[key])
        if bool(value.any()):
            raise CheckpointError(
                f"optimizer state {key!r} of {name} is non-zero although its step is 0; "
                "state that was never stepped must have zero moments."
            )
    master = entry.get("master_weight")
    if master is not None:
        mine, live = local(master), local(param)
        if not torch.equal(mine, live.to(device=mine.device, dtype=mine.dtype)):
            raise CheckpointError(
                f"optimizer state 'master_weight' of {name} has step 0 but differs from the live "
                "parameter; never-stepped state must match the weights it is loaded with (load "
                "the model weights of the same checkpoint first)."
            )
