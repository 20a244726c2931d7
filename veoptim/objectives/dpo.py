"""Direct preference optimisation: sigmoid DPO (with label smoothing) and IPO.

For a pair, ``h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))``
with sequence log-probabilities summed over the response tokens (IPO: averaged).
Sigmoid DPO: ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``;
IPO: ``(h - 1 / (2 * beta))^2``. Rewards are ``beta * (log pi - log ref)`` per side
(TRL's definitions and metric names). The reference is the starting policy: a frozen
copy sharded with the same plan, or with LoRA the base itself with its adapters
disabled (no second copy). It is rebuilt from ``model.path`` / ``model.init_seed`` at
every start, never saved, and never trained.

A micro-batch's loss is the *sum* over its pairs; the trainer divides by the global
number of pairs, so logged metrics are means over the step's pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from veoptim.checkpoint import StateComponent
from veoptim.data.fields import INPUT_IDS, LABELS
from veoptim.data.pairs import PairDataset, collate_pairs
from veoptim.errors import ConfigError
from veoptim.lora import adapters_disabled
from veoptim.losses import sequence_logps
from veoptim.trainer.objective import LossSum, MicroBatch

if TYPE_CHECKING:
    from veoptim.objectives.schema import DPOSection

LOSSES = ("sigmoid", "ipo")


def check_dpo(cfg: DPOSection) -> None:
    if cfg.loss not in LOSSES:
        raise ConfigError(f"dpo.loss must be one of {list(LOSSES)}, got {cfg.loss!r}.")
    if not cfg.beta > 0:
        raise ConfigError(f"dpo.beta must be > 0, got {cfg.beta}.")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {cfg.label_smoothing}.")
    if cfg.loss == "ipo" and cfg.label_smoothing:
        raise ConfigError("dpo.label_smoothing applies to the sigmoid loss; set it to 0 for ipo.")


@dataclass
class PreferenceLoss:
    """Per pair: the loss and both rewards (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    cfg: DPOSection,
) -> PreferenceLoss:
    """The DPO or IPO loss of each pair from its four (sequence) log-probabilities."""
    h = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if cfg.loss == "ipo":
        losses = (h - 1.0 / (2.0 * cfg.beta)) ** 2
    else:
        eps = cfg.label_smoothing
        losses = -F.logsigmoid(cfg.beta * h) * (1 - eps) - F.logsigmoid(-cfg.beta * h) * eps
    return PreferenceLoss(
        losses,
        cfg.beta * (policy_chosen - reference_chosen).detach(),
        cfg.beta * (policy_rejected - reference_rejected).detach(),
    )


class DPOObjective:
    """Preference pairs; the loss of each pair against the frozen reference."""

    normaliser_name = "preference pairs"

    def __init__(self, dataset: PairDataset, pad_id: int, cfg: DPOSection, use_lora: bool) -> None:
        self.dataset, self.pad_id, self.cfg, self.use_lora = dataset, pad_id, cfg, use_lora
        self.num_examples = len(dataset)
        self.data_fingerprint = dataset.fingerprint
        #: The frozen copy of the starting policy (full fine-tuning only).
        self.reference_model: nn.Module | None = None

    def setup(self, model: nn.Module, starting_model: Callable[[], nn.Module]) -> None:
        """Full fine-tuning builds the frozen reference; LoRA uses the base itself."""
        if not self.use_lora:
            self.reference_model = starting_model()

    def micro_batch(self, indices: list[int]) -> MicroBatch:
        batch = collate_pairs([self.dataset[i] for i in indices], self.pad_id)
        return MicroBatch(
            inputs=batch,
            normaliser=len(indices),
            tokens=int((batch[INPUT_IDS] != self.pad_id).sum()),
        )

    @torch.no_grad()
    def reference_logps(
        self, model: nn.Module, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence log-probs of every row under the reference."""
        model_inputs = {k: v for k, v in inputs.items() if k != LABELS}
        if self.reference_model is not None:
            logits = self.reference_model(**model_inputs, use_cache=False).logits
        else:
            with adapters_disabled(model):
                logits = model(**model_inputs, use_cache=False).logits
        return sequence_logps(logits, inputs[LABELS])

    def loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> LossSum:
        reference, _ = self.reference_logps(model, inputs)
        model_inputs = {k: v for k, v in inputs.items() if k != LABELS}
        logits = model(**model_inputs, use_cache=False).logits
        policy, counts = sequence_logps(logits, inputs[LABELS])
        if self.cfg.loss == "ipo":  # IPO compares mean token log-probs
            policy, reference = policy / counts, reference / counts
        n = policy.shape[0] // 2
        out = preference_loss(policy[:n], policy[n:], reference[:n], reference[n:], self.cfg)
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        return LossSum(
            out.losses.sum(),
            {
                "rewards/chosen": chosen.sum(),
                "rewards/rejected": rejected.sum(),
                "rewards/margins": (chosen - rejected).sum(),
                "rewards/accuracies": (chosen > rejected).float().sum(),
                "logps/chosen": policy[:n].detach().sum(),
                "logps/rejected": policy[n:].detach().sum(),
            },
        )

    def eval_metrics(self, loss: float, metrics: dict[str, float]) -> dict[str, float]:
        """Loss, rewards and log-probs as means over the eval pairs (no perplexity: the
        loss is not a token cross-entropy)."""
        return {"loss": loss, **metrics}

    def state_components(self) -> Mapping[str, StateComponent]:
        return {}
