"""The one table from config dtype names to torch dtypes.

Model, FSDP mixed precision, optimizer moments and HF export all spell dtypes
the same way in config; keeping the table here means a new name is added once
and every error lists the same choices. The table names torch's dtypes rather than
holding them, so config validation (which needs only the names) imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from veoptim.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: Config dtype name -> the name of its torch dtype (``torch.float32``, ...).
DTYPE_NAMES: Mapping[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: Where FP16 has no place: Adam moments (``exp_avg_sq`` under- and overflows FP16's range)
#: and gradient reductions (loss-scaled gradients overflow it); these keys take only these.
WIDE_RANGE_DTYPE_NAMES: tuple[str, ...] = ("fp32", "bf16")
#: The dtype whose compute needs a loss scaler (``veoptim/optim/loss_scale.py``).
LOSS_SCALED_DTYPE = "fp16"


def torch_dtypes() -> dict[str, torch.dtype]:
    """Config dtype name -> torch dtype, for every name of :data:`DTYPE_NAMES`."""
    import torch

    return {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}


def resolve_dtype(name: str, key: str) -> torch.dtype:
    """Map a config dtype name to a torch dtype; ConfigError names ``key`` and the choices."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"{key} must be one of {sorted(DTYPE_NAMES)}, got {name!r}.")
    import torch

    return getattr(torch, DTYPE_NAMES[name])
