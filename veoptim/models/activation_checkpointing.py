"""Per decoder layer activation checkpointing (``model.activation_checkpointing``).

transformers' own mechanism is used on purpose: it sets a flag on each decoder layer
(a ``GradientCheckpointingLayer``) instead of wrapping it, so no module or parameter
name changes and state dicts, checkpoints and exports are the same with and without
it. It checkpoints the layer's ``forward`` rather than ``__call__``, so FSDP2's hooks
on the layer stay outside the recomputed region (the layer is unsharded once for the
backward, not again for the recompute); hooks of modules inside the layer (an expert
module's own FSDP2 unit) run again in the recompute. The recompute is torch's
non-reentrant ``torch.utils.checkpoint``, which restores the RNG state, so dropout
draws the same masks and gradients are bitwise those of a run without it.
"""

from __future__ import annotations

import logging

from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from veoptim.errors import ConfigError

log = logging.getLogger(__name__)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them.

    Applies in training mode only (an ``eval()`` model, such as DPO's frozen reference,
    runs as before), and before or after LoRA injection and the parallel plan alike.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"model.activation_checkpointing=true, but transformers' {type(model).__name__} "
            "does not support activation checkpointing; set model.activation_checkpointing=false."
        )
    model.activation_checkpointing_enable({"use_reentrant": False})
    # transformers also makes the embedding output require grad, which only the reentrant
    # variant needs; without it a frozen embedding (LoRA) stays out of the autograd graph.
    model.disable_input_require_grads()
    layers = checkpointed_layers(model)
    if layers:
        log.info("activation checkpointing: %d decoder layers recompute in the backward", layers)
    else:  # a model whose layers are not transformers' GradientCheckpointingLayer
        log.warning(
            "model.activation_checkpointing=true, but no layer of %s recomputes its "
            "activations: memory use is as without it.",
            type(model).__name__,
        )


def checkpointed_layers(model: PreTrainedModel) -> int:
    """How many decoder layers of ``model`` recompute their activations (0: checkpointing is off)."""
    return sum(
        isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        for m in model.modules()
    )
