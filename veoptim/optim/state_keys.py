"""Names of everything the exact-precision optimizers put into a state dict.

The checkpoint code derives its expected-key inventory from these constants, so
they are the single source of truth for the optimizer part of the format.
"""

from __future__ import annotations

import torch

MASTER_WEIGHT = "master_weight"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
STEP = "step"

#: State keys of every exact-precision optimizer, in a fixed order.
EXACT_STATE_KEYS: tuple[str, ...] = (MASTER_WEIGHT, EXP_AVG, EXP_AVG_SQ, STEP)
#: State keys of the plain ``adamw`` type (``torch.optim.AdamW`` without amsgrad).
TORCH_ADAMW_STATE_KEYS: tuple[str, ...] = (STEP, EXP_AVG, EXP_AVG_SQ)

#: Param-group flag of ``cpu_offload_adamw``: placement policy of the current run,
#: never written into a state dict.
CPU_OFFLOAD = "cpu_offload"

MASTER_DTYPE = torch.float32
STEP_DTYPE = torch.float32

#: Parameter dtypes the exact optimizers accept (FP32 master is exact for each).
SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
