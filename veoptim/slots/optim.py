"""One slot's optimizer, LR schedule and pending gradients.

Each slot gets its own optimizer of the configured type (``optim.name``: FP32 masters
for BF16 adapters with the exact types) over only its own parameters, and its own
scheduler; stepping one slot cannot touch another's state because no other slot's
tensors are in it. Gradients accumulate as *sums* over the slot's tokens (over every
``forward_backward`` since its last step); the step divides them by the accumulated
global token count, so a slot's update is the token mean however its rows were batched.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from veoptim.config.schema import OptimConfig, SchedulerConfig
from veoptim.distributed.grad_norm import clip_grad_norm_
from veoptim.errors import ConfigError
from veoptim.lora.peft_format import full_cpu
from veoptim.optim import build_optimizer, build_scheduler
from veoptim.optim.state_keys import EXP_AVG, EXP_AVG_SQ, MASTER_WEIGHT, STEP
from veoptim.slots.routing import SlotParams
from veoptim.state.optimizer import to_json_param_groups

WEIGHTS = "weights"
#: The per-parameter tensors of :meth:`SlotOptimizer.snapshot`.
SNAPSHOT_TENSORS = (WEIGHTS, MASTER_WEIGHT, EXP_AVG, EXP_AVG_SQ, STEP)
#: Keyword arguments ``create_slot`` / ``optim_step`` accept for the optimizer.
OPTIM_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class SlotHyper:
    """A slot's optimizer hyperparameters (``lr`` is the peak the schedule scales)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> SlotHyper:
        return cls(cfg.lr, (float(cfg.betas[0]), float(cfg.betas[1])), cfg.eps, cfg.weight_decay)

    def updated(self, **changes: Any) -> SlotHyper:
        unknown = sorted(set(changes) - set(OPTIM_KEYS))
        if unknown:
            raise ConfigError(f"unknown optimizer hyperparameters {unknown}; known: {OPTIM_KEYS}.")
        given = {k: v for k, v in changes.items() if v is not None}
        if "betas" in given:
            given["betas"] = tuple(float(b) for b in given["betas"])
        new = dataclasses.replace(self, **given)
        if not (
            new.lr >= 0
            and new.eps >= 0
            and new.weight_decay >= 0
            and len(new.betas) == 2
            and all(0.0 <= b < 1.0 for b in new.betas)
        ):
            raise ConfigError(
                f"slot hyperparameters need lr, eps, weight_decay >= 0 and two betas in [0, 1); "
                f"got {dataclasses.asdict(new)}."
            )
        return new


class SlotOptimizer:
    """The optimizer and scheduler of one slot, and its accumulated token count."""

    def __init__(
        self,
        params: SlotParams,
        optim_cfg: OptimConfig,
        scheduler_cfg: SchedulerConfig,
        max_steps: int,
        hyper: SlotHyper,
    ) -> None:
        cfg = dataclasses.replace(
            optim_cfg,
            lr=hyper.lr,
            betas=list(hyper.betas),
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
        )
        self.params, self.hyper = params, hyper
        self.optimizer = build_optimizer(params, cfg)  # type: ignore[arg-type]
        self.scheduler = build_scheduler(self.optimizer, scheduler_cfg, max_steps)
        no_decay = [re.compile(p) for p in optim_cfg.no_decay_patterns]
        names = self.optimizer.param_names  # type: ignore[attr-defined]
        #: Per group: whether weight decay applies (optim.no_decay_patterns exempts groups).
        self._decays = [
            not all(any(r.search(names[id(p)]) for r in no_decay) for p in group["params"])
            for group in self.optimizer.param_groups
        ]
        #: Per group: its LR as a multiple of the slot's (optim.param_groups may scale it).
        self._lr_ratios = [
            (base / hyper.lr if hyper.lr else 1.0) for base in self.scheduler.base_lrs
        ]
        self.pending_tokens = 0.0

    @property
    def steps(self) -> int:
        return int(self.scheduler.last_epoch)

    def set_hyper(self, hyper: SlotHyper) -> None:
        """Apply ``hyper`` to every group from now on (the current step's LR included)."""
        self.hyper = hyper
        sched = self.scheduler
        sched.base_lrs = [hyper.lr * ratio for ratio in self._lr_ratios]
        sched._last_lr = sched.get_lr()  # closed form of the current step
        groups = self.optimizer.param_groups
        for group, base, lr, decays in zip(
            groups, sched.base_lrs, sched._last_lr, self._decays, strict=True
        ):
            group.update(initial_lr=base, lr=lr, betas=hyper.betas, eps=hyper.eps)
            group["weight_decay"] = hyper.weight_decay if decays else 0.0

    def hyper_from_groups(self) -> SlotHyper:
        """The hyperparameters the groups hold now (after a checkpoint was loaded)."""
        groups = self.optimizer.param_groups
        decaying = [g for g, d in zip(groups, self._decays, strict=True) if d]
        return SlotHyper(
            lr=self.scheduler.base_lrs[0] / self._lr_ratios[0],
            betas=tuple(float(b) for b in groups[0]["betas"]),  # type: ignore[arg-type]
            eps=float(groups[0]["eps"]),
            weight_decay=float(decaying[0]["weight_decay"])
            if decaying
            else self.hyper.weight_decay,
        )

    def step(self, grad_clip: float) -> dict[str, float]:
        """Clip and step on the token mean of the accumulated gradient sums, then schedule."""
        scale = 1.0 / self.pending_tokens
        norm = clip_grad_norm_(self.params.parameters(), grad_clip or math.inf, scale=scale)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        return {"lr": lr, "grad_norm": float(norm), "step": self.steps}

    def snapshot(self) -> dict[str, Any]:
        """Whole CPU copies of the slot's weights and optimizer state (by slot-independent
        name), its param groups, schedule, spec and step count. Gathers shards: collective."""
        optimizer = self.optimizer
        out: dict[str, Any] = {key: {} for key in SNAPSHOT_TENSORS}
        for name, param in self.params.named:
            out[WEIGHTS][name] = full_cpu(param).clone()
            for key, value in optimizer.state.get(param, {}).items():
                if key in out and isinstance(value, torch.Tensor):
                    out[key][name] = full_cpu(value).clone()
        groups = to_json_param_groups(optimizer.state_dict()["param_groups"])
        out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        out["scheduler"] = self.scheduler.state_dict()
        out["spec"] = dataclasses.asdict(self.params.spec)
        out["steps"] = self.steps
        return out

    def zero_grad(self) -> None:
        for p in self.params.parameters():
            p.grad = None
        self.pending_tokens = 0.0
