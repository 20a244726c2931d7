"""The components every training run checkpoints, built from the objects they hold.

A full checkpoint holds all of :func:`standard_components` (plus any a task registers); a
weights-only one (``checkpoint.save_optimizer=false``) the model and the config, checked on
a load by the model keys only (:func:`weights_only`). Install order is the mapping's order:
weights before the optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from veoptim.checkpoint import StateComponent
from veoptim.state import (
    CONFIG,
    LOSS_SCALE,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    PROGRESS,
    RNG,
    RUN_IDS,
    SAMPLER,
    JSONState,
    ModelState,
    OptimizerState,
    RNGState,
    RunConfigState,
)
from veoptim.state.run_config import WEIGHTS_ONLY_MUST_MATCH
from veoptim.state.stateful import same_structure


def standard_components(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    progress: Any,
    run_ids: Any,
    device: torch.device,
    world_size: int,
    layout: Any,
    config: dict[str, Any],
    defaults: dict[str, Any],
    weights: StateComponent | None = None,
    loss_scaler: Any = None,
) -> dict[str, StateComponent]:
    """Model (``weights``; by default all of ``model``'s weights, and for a LoRA run the
    adapters' own component, ``veoptim.lora.state.LoRAModelState``, which records their
    base), optimizer (with the parallel ``layout`` its shards follow), LR scheduler,
    sampler, progress, RNG, the run ``config`` (keys a checkpoint predates compared with
    ``defaults``), the run ids, and an fp16 run's ``loss_scaler``."""
    components: dict[str, StateComponent] = {
        MODEL: ModelState(model) if weights is None else weights,
        OPTIMIZER: OptimizerState(model, optimizer, layout),
        # An LR scheduler holds its optimizer: checked by structure, not by a trial load.
        LR_SCHEDULER: JSONState(scheduler, check=same_structure),
        SAMPLER: JSONState(sampler),
        PROGRESS: JSONState(progress),
        RNG: RNGState(device, world_size),
        CONFIG: RunConfigState(config, defaults=defaults),
        RUN_IDS: JSONState(run_ids),
    }
    if loss_scaler is not None:
        components[LOSS_SCALE] = JSONState(loss_scaler)
    return components


def weights_only(
    components: Mapping[str, StateComponent], config: dict[str, Any]
) -> dict[str, StateComponent]:
    """The components of a weights-only checkpoint: the model, and the config checked on a
    load by the model keys only."""
    return {MODEL: components[MODEL], CONFIG: RunConfigState(config, WEIGHTS_ONLY_MUST_MATCH)}
