"""Names of the per-example and per-batch tensors, and the label value that carries no loss."""

from __future__ import annotations

INPUT_IDS = "input_ids"
LABELS = "labels"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"

# Labels equal to this are ignored by the loss (PyTorch's cross_entropy default).
IGNORE_INDEX = -100
