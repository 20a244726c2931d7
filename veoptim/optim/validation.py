"""Argument checks shared by the optimizer classes, run before anything is mutated.

Optimizers are also built directly (tests, notebooks, other entry points), not
only from a validated config, so each class checks its own arguments: a string
``"false"`` for a boolean option must be an error, not a truthy value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from veoptim.dtypes import DTYPES
from veoptim.errors import ConfigError

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


def check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"optimizer option {name!r} must be an int, got {value!r}.")


def check_moment_dtype(name: str, value: Any) -> None:
    """Moment dtypes come from the config dtype table (veoptim/dtypes.py)."""
    allowed = list(DTYPES.values())
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise ConfigError(
            f"optimizer option {name!r} must be one of {[str(d) for d in allowed]}, got {value!r}."
        )
