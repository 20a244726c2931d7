"""The one table from config dtype names to torch dtypes.

Model, FSDP mixed precision, optimizer moments and HF export all spell dtypes
the same way in config; keeping the table here means a new name is added once
and every error lists the same choices.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from veoptim.errors import ConfigError

#: Config dtype name -> torch dtype.
DTYPES: Mapping[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(name: str, key: str) -> torch.dtype:
    """Map a config dtype name to a torch dtype; ConfigError names ``key`` and the choices."""
    if name not in DTYPES:
        raise ConfigError(f"{key} must be one of {sorted(DTYPES)}, got {name!r}.")
    return DTYPES[name]
