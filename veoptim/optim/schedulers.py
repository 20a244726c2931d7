"""LR schedules with linear warmup: constant, linear, cosine, warmup-stable-decay.

The LR of step ``s`` is a closed-form function of ``s`` (no chained products),
so a scheduler restored from its state dict reproduces the continuous run's LR
bit for bit. Warmup follows torchtitan: ``(s + 1) / (warmup + 1)``, so the
first step never runs at LR 0. A ratio of the run's steps (``warmup_ratio``, ``decay_ratio``)
is a whole number of steps by :func:`ratio_steps`.
"""

from __future__ import annotations

import logging
import math
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from veoptim.config.schema import SchedulerConfig
from veoptim.errors import ConfigError

log = logging.getLogger(__name__)

SUPPORTED_SCHEDULERS = ("constant", "linear", "cosine", "wsd")
#: Keys of the scheduler state dict (counters only; the shape comes from the live config).
SCHEDULER_STATE_KEYS = ("last_epoch", "_step_count", "base_lrs", "_last_lr")


def ratio_steps(ratio: float, max_steps: int) -> int:
    """``ratio * max_steps`` rounded to the nearest step, a half up (0.1 x 15 = 1.5 -> 2,
    0.1 x 25 = 2.5 -> 3), on the ratio as written in decimal: the float product decided
    halves by its rounding noise (0.07 x 150 -> 11 but 0.35 x 90 = 31.5 -> 31)."""
    return int((Decimal(repr(ratio)) * max_steps).to_integral_value(rounding=ROUND_HALF_UP))


def warmup_steps(cfg: SchedulerConfig, max_steps: int) -> int:
    """Warmup steps: ``warmup_ratio`` of ``max_steps`` when set (:func:`ratio_steps`),
    else ``warmup_steps``."""
    if cfg.warmup_ratio:
        return ratio_steps(cfg.warmup_ratio, max_steps)
    return cfg.warmup_steps


def lr_factor(cfg: SchedulerConfig, max_steps: int, step: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    warmup = warmup_steps(cfg, max_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.name == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.name == "wsd":
        decay_steps = max(1, ratio_steps(cfg.decay_ratio, max_steps))
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - warmup + 1) / max(1, max_steps - warmup))
    if cfg.name == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def validate_scheduler_config(cfg: SchedulerConfig, max_steps: int) -> None:
    """Reject unknown names and inconsistent warmup/decay settings (ConfigError)."""
    if cfg.name not in SUPPORTED_SCHEDULERS:
        raise ConfigError(
            f"scheduler.name must be one of {list(SUPPORTED_SCHEDULERS)}, got {cfg.name!r}."
        )
    if max_steps < 1 or cfg.warmup_steps < 0:
        raise ConfigError(
            f"scheduler.warmup_steps must be >= 0 and train.max_steps >= 1; got "
            f"warmup_steps={cfg.warmup_steps}, max_steps={max_steps}."
        )
    if not 0.0 <= cfg.warmup_ratio < 1.0 or (cfg.warmup_ratio and cfg.warmup_steps):
        raise ConfigError(
            "scheduler.warmup_ratio must be in [0, 1) and set only with scheduler.warmup_steps=0; "
            f"got warmup_ratio={cfg.warmup_ratio}, warmup_steps={cfg.warmup_steps}."
        )
    warmup = warmup_steps(cfg, max_steps)
    if warmup >= max_steps and cfg.name != "wsd":
        # A short trial run (train.max_steps=5) must not need a second override.
        log.warning(
            "scheduler.warmup_steps=%d >= train.max_steps=%d: the whole run is warmup and the "
            "LR peaks at %.3g of optim.lr (set scheduler.warmup_steps below max_steps to reach "
            "the peak and decay).",
            warmup,
            max_steps,
            max_steps / (warmup + 1),
        )
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"scheduler.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}.")
    if cfg.name == "wsd":
        decay = ratio_steps(cfg.decay_ratio, max_steps)
        if not 0.0 < cfg.decay_ratio <= 1.0 or warmup + decay > max_steps:
            raise ConfigError(
                "scheduler.decay_ratio must be in (0, 1] and warmup_steps + decay steps <= "
                f"max_steps; got decay_ratio={cfg.decay_ratio}, warmup_steps={warmup}, "
                f"max_steps={max_steps}."
            )


class WarmupScheduler(LRScheduler):
    """``base_lr * lr_factor(step)`` for every param group."""

    def __init__(self, optimizer: Optimizer, cfg: SchedulerConfig, max_steps: int) -> None:
        validate_scheduler_config(cfg, max_steps)
        self.cfg = cfg
        self.max_steps = max_steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        factor = lr_factor(self.cfg, self.max_steps, self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in SCHEDULER_STATE_KEYS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters and write the restored LR into the optimizer's groups."""
        missing = [k for k in SCHEDULER_STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"Scheduler state dict is missing {missing}.")
        if len(state_dict["base_lrs"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"Scheduler state has {len(state_dict['base_lrs'])} LRs; the optimizer has "
                f"{len(self.optimizer.param_groups)} param groups."
            )
        for k in SCHEDULER_STATE_KEYS:
            value = state_dict[k]
            self.__dict__[k] = list(value) if isinstance(value, (list, tuple)) else value
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def build_scheduler(optimizer: Optimizer, cfg: SchedulerConfig, max_steps: int) -> LRScheduler:
    """The configured schedule over ``max_steps`` optimizer steps."""
    return WarmupScheduler(optimizer, cfg, max_steps)
