"""Optimizers: builder, the four AdamW types, state inventory, LR schedulers."""

from veoptim.optim.base import dcp_state_init
from veoptim.optim.builder import SUPPORTED_OPTIMIZERS, build_optimizer, build_param_groups
from veoptim.optim.checks import expected_optimizer_state
from veoptim.optim.exact_adamw import CPUOffloadAdamW, ExactAdamW, FullFP32AdamW, MasterFP32AdamW
from veoptim.optim.schedulers import SUPPORTED_SCHEDULERS, WarmupScheduler, build_scheduler
from veoptim.optim.state_keys import (
    CPU_OFFLOAD,
    EXACT_STATE_KEYS,
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_WEIGHT,
    STEP,
    TORCH_ADAMW_STATE_KEYS,
)
from veoptim.optim.torch_adamw import AdamW

__all__ = [
    "CPU_OFFLOAD",
    "EXACT_STATE_KEYS",
    "EXP_AVG",
    "EXP_AVG_SQ",
    "MASTER_WEIGHT",
    "STEP",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "TORCH_ADAMW_STATE_KEYS",
    "AdamW",
    "CPUOffloadAdamW",
    "ExactAdamW",
    "FullFP32AdamW",
    "MasterFP32AdamW",
    "WarmupScheduler",
    "build_optimizer",
    "build_param_groups",
    "build_scheduler",
    "dcp_state_init",
    "expected_optimizer_state",
]
