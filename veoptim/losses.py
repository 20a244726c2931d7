"""Next-token log-probabilities of labelled positions: the one place the causal shift is done
for per-sequence quantities (DPO's sequence log-probs, a slot's per-row loss sums)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from veoptim.data.fields import IGNORE_INDEX


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability (FP32) of its labelled next tokens, and how many."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    token_logps = -F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    return token_logps.sum(dim=1), (shift_labels != IGNORE_INDEX).sum(dim=1)
