"""Causal-LM loss normalised over the global batch (not a mean of per-rank means)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from veoptim.data import IGNORE_INDEX


def count_loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that carry a loss after the causal shift."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy in FP32 over labelled positions."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
