"""What a task gives the trainer: its data and its loss, as a sum plus a global normaliser.

The loop knows nothing else about the task. For one optimizer step it asks the
objective for each micro-batch (:meth:`Objective.micro_batch`), sums every
micro-batch's ``normaliser`` over all ranks, and back-propagates
``loss_sum / global_normaliser`` per micro-batch. Because the division is by the
*global* count, the step's loss is exact whatever the number of ranks and
accumulation steps (not a mean of per-rank means). Metric sums an objective
reports are normalised the same way before they are logged.

Evaluation (``evaluation.py``) computes the same loss over the eval set. An objective
may define ``eval_metrics(loss, metrics) -> dict[str, float]`` to choose what an
evaluation reports from the eval set's mean loss and normalised metric sums (SFT adds
the perplexity); without it, the loss and the metrics are reported as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from veoptim.checkpoint import StateComponent


@dataclass
class MicroBatch:
    """One micro-batch on this rank: model inputs (on CPU) and what it counts for."""

    inputs: dict[str, torch.Tensor]
    #: Units the loss is a sum over (e.g. labelled tokens); summed over ranks and micro-batches.
    normaliser: int
    #: Non-padding input tokens, for throughput and ``tokens_seen``.
    tokens: int


@dataclass
class LossSum:
    """A micro-batch's loss summed over its normaliser units, plus metric sums to log."""

    total: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """A task's data and loss (see the module docstring)."""

    #: Number of examples the sampler draws indices from.
    num_examples: int
    #: Identifies the examples behind the indices (a resumed data order checks it).
    data_fingerprint: str
    #: What the normaliser counts, for the error when a global batch has none.
    normaliser_name: str

    def setup(self, model: torch.nn.Module, starting_model: Callable[[], torch.nn.Module]) -> None:
        """Called once after the model is built and sharded, before any resume.
        ``starting_model()`` builds another copy of the starting weights (``model.path`` or
        ``model.init_seed``), frozen, in eval mode and sharded with the same plan (e.g. a
        reference model); most objectives need neither and do nothing."""
        ...

    def micro_batch(self, indices: list[int]) -> MicroBatch: ...

    def loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> LossSum: ...

    def state_components(self) -> Mapping[str, StateComponent]:
        """Extra checkpointed state the objective owns (none for most)."""
        ...
