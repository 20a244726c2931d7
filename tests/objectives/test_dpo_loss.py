"""DPO and IPO losses, rewards and sequence log-probabilities against direct computations."""

from __future__ import annotations

import math

import pytest
import torch

from veoptim.errors import ConfigError
from veoptim.losses import sequence_logps
from veoptim.objectives.dpo import check_dpo, preference_loss
from veoptim.objectives.schema import DPOSection

#: Sequence log-probs of three pairs: policy chosen/rejected, reference chosen/rejected.
PC = torch.tensor([-4.0, -9.5, -2.25], dtype=torch.float64)
PR = torch.tensor([-7.0, -8.0, -2.0], dtype=torch.float64)
RC = torch.tensor([-5.0, -9.0, -3.0], dtype=torch.float64)
RR = torch.tensor([-6.0, -8.5, -2.5], dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.0), (0.2, 0.3)])
def test_sigmoid_loss_matches_the_formula(beta, smoothing):
    out = preference_loss(PC, PR, RC, RR, DPOSection(beta=beta, label_smoothing=smoothing))
    for i in range(3):
        h = (PC[i] - PR[i]).item() - (RC[i] - RR[i]).item()
        expected = -(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h)
        assert out.losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * (PC[i] - RC[i]).item())
        assert out.rejected_rewards[i].item() == pytest.approx(beta * (PR[i] - RR[i]).item())
    # pair 0 prefers chosen more than the reference does, pair 1 less
    assert out.chosen_rewards[0] > out.rejected_rewards[0]
    assert out.chosen_rewards[1] < out.rejected_rewards[1]


def test_ipo_loss_matches_the_formula():
    beta = 0.25
    out = preference_loss(PC, PR, RC, RR, DPOSection(beta=beta, loss="ipo"))
    for i in range(3):
        h = (PC[i] - PR[i]).item() - (RC[i] - RR[i]).item()
        assert out.losses[i].item() == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-12)


def test_equal_policy_and_reference_give_log_2():
    out = preference_loss(RC, RR, RC, RR, DPOSection(beta=0.1))
    assert torch.allclose(out.losses, torch.full_like(out.losses, math.log(2)))
    assert not out.chosen_rewards.any() and not out.rejected_rewards.any()


def test_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    preference_loss(pc, pr, RC, RR, DPOSection(beta=0.1)).losses.sum().backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()


def test_sequence_logps_sum_the_labelled_next_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, 1], [-100, 2, -100, 6, -100]])
    logps, counts = sequence_logps(logits, labels)
    log_probs = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        expected = sum(
            log_probs[row, t - 1, labels[row, t]].item()
            for t in range(1, 5)
            if labels[row, t] != -100
        )
        assert logps[row].item() == pytest.approx(expected, rel=1e-6)
    assert counts.tolist() == [3, 2]


@pytest.mark.parametrize(
    "section,match",
    [
        (DPOSection(loss="kto"), "dpo.loss"),
        (DPOSection(beta=0.0), "dpo.beta"),
        (DPOSection(label_smoothing=0.5), "dpo.label_smoothing"),
        (DPOSection(loss="ipo", label_smoothing=0.1), "ipo"),
    ],
)
def test_bad_settings_are_refused(section, match):
    with pytest.raises(ConfigError, match=match):
        check_dpo(section)
