"""``model.compile``: each decoder layer compiled by ``torch.compile`` (inductor).

Per layer, as torchtitan does: one graph per layer kind, compiled once and reused by every
layer, and the parallel plan (FSDP2 wraps each layer afterwards) and activation
checkpointing stay as they are. ``nn.Module.compile`` compiles the layer's call in place,
so no module or parameter name changes: state dicts, checkpoints and exports are those of
an eager model. Shapes are dynamic (micro-batches change length from step to step).

What it pays for: the element-wise work between the matrix products (norms, rotary,
SiLU, residuals and their backward) fused into fewer passes over memory. What it costs:
the first steps compile (tens of seconds per layer kind on a CPU), and the fused kernels
round differently from eager ones, so compiled and eager runs agree within rounding, not
bitwise; a resume is bitwise within either mode.
"""

from __future__ import annotations

import logging

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

log = logging.getLogger(__name__)


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer of ``model`` in place; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("model.compile: %d decoder layers compile on their first call", len(layers))
    return len(layers)
