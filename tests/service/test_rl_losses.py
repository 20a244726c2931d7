"""The RL losses (importance_sampling, ppo, cispo): value and gradient equal a direct
implementation of the documented formula (docs/service.md), on FP32 log-probabilities
with ratios on both sides of and at the clipping thresholds, and through the SDK on a
server in this process (loss:sum and the slot's gradient)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.service.helpers import BASE_MODEL, examples
from tests.service.test_exact import direct_batch
from veoptim.service.errors import ServiceError
from veoptim.service.losses import get_loss
from veoptim.slots.tokens import forward_tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
RL = ("importance_sampling", "ppo", "cispo")
CONFIG = {"importance_sampling": {}, "ppo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
          "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}  # fmt: skip
#: Ratios exp(logp - q) to place every token at: below, at, inside, at and above the bounds.
RATIOS = (0.5, 0.7, 0.75, 0.9, 1.0, 1.1, 1.2, 1.3, 1.6, 2.5)


def documented(name: str, logp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor,
               low: float = 0.8, high: float = 1.2) -> torch.Tensor:  # fmt: skip
    """The per-datum loss as the Tinker documentation writes it (summed over tokens)."""
    prob_ratio = torch.exp(logp - q)
    if name == "importance_sampling":
        return -(prob_ratio * adv).sum(-1)
    clipped = torch.clamp(prob_ratio, low, high)
    if name == "ppo":
        return -torch.min(prob_ratio * adv, clipped * adv).sum(-1)
    return -(clipped.detach() * logp * adv).sum(-1)


def analytic_grad(name: str, logp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor,
                  low: float, high: float) -> torch.Tensor:  # fmt: skip
    """d loss / d logp, derived by hand (the ratio as FP32 computes it, then float64)."""
    r32 = torch.exp(logp - q)
    lo, hi = torch.tensor(low, dtype=torch.float32), torch.tensor(high, dtype=torch.float32)
    r, adv = r32.double(), adv.double()
    if name == "importance_sampling":
        return -r * adv
    if name == "cispo":
        return -r32.clamp(lo, hi).double() * adv
    # ppo: the unclipped term is the minimum (gradient -r A) unless the ratio is outside
    # the bounds on the side where clipping lowers the objective (gradient 0)
    clipped_wins = ((r32 > hi) & (adv > 0)) | ((r32 < lo) & (adv < 0))
    return torch.where(clipped_wins, torch.zeros_like(r), -r * adv)


def edge_case_batch(low: float, high: float) -> tuple[torch.Tensor, ...]:
    ratios = sorted({*RATIOS, low, high, math.nextafter(low, 0), math.nextafter(high, 9)})
    generator = torch.Generator().manual_seed(0)
    n = len(ratios)
    logp = -torch.rand(2, n, generator=generator) * 3  # two datums, both advantage signs
    q = logp - torch.log(torch.tensor(ratios, dtype=torch.float32))
    adv = torch.tensor([[0.5] * n, [-1.5] * n])
    adv[0, 3] = 0.0
    return logp, q, adv


@pytest.mark.parametrize("name", RL)
def test_each_rl_loss_equals_the_documented_formula_at_the_clipping_edges(name):
    config = CONFIG[name]
    loss = get_loss(name, config)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    logp, q, adv = edge_case_batch(low, high)
    mine = logp.clone().requires_grad_(True)
    value = loss.row_losses(mine, {"logprobs": q, "advantages": adv})
    value.sum().backward()
    theirs = logp.clone().requires_grad_(True)
    expected = documented(name, theirs, q, adv, low, high)
    expected.sum().backward()
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-6)
    hand = analytic_grad(name, logp, q, adv, low, high)
    torch.testing.assert_close(mine.grad.double(), hand, rtol=0, atol=1e-6)
    if name != "importance_sampling":  # clipping happened on both sides, and not everywhere
        assert (hand == 0).any() or name == "cispo"
        assert (mine.grad != 0).any()


def test_ppo_and_cispo_default_to_the_documented_thresholds():
    for name in ("ppo", "cispo"):
        loss = get_loss(name, {})
        assert (loss.low, loss.high) == (0.8, 1.2)


@pytest.mark.parametrize(
    ("name", "config", "words"),
    [
        ("dro", {}, ("loss_fn", "'dro'", "importance_sampling")),
        ("gspo", {}, ("loss_fn", "'gspo'")),
        ("ppo", {"clip_ratio": 0.2}, ("loss_fn_config", "clip_ratio", "clip_low_threshold")),
        ("importance_sampling", {"clip_low_threshold": 0.8}, ("loss_fn_config", "takes none")),
        ("cispo", {"clip_low_threshold": 1.5}, ("clip_low_threshold <= clip_high_threshold",)),
        ("ppo", {"clip_high_threshold": "wide"}, ("loss_fn_config['clip_high_threshold']",)),
    ],
)
def test_unsupported_losses_and_bad_configs_are_refused_by_name(name, config, words):
    with pytest.raises(ServiceError) as caught:
        get_loss(name, config)
    for word in words:
        assert word in caught.value.message, caught.value.message


def rl_data(data: list[types.Datum], logprobs: list[np.ndarray]) -> tuple[list[types.Datum], ...]:
    """The datums as RL datums: sampler logprobs that put the ratios across the clipping
    range, advantages of both signs."""
    out, qs, advs = [], [], []
    for i, (d, logp) in enumerate(zip(data, logprobs, strict=True)):
        n = logp.shape[0]
        ratios = np.array([RATIOS[(i + t) % len(RATIOS)] for t in range(n)], np.float32)
        q = (logp - np.log(ratios)).astype(np.float32)
        adv = np.where(np.arange(n) % 3 == i % 3, -1.0, 0.75).astype(np.float32)
        target = d.loss_fn_inputs["target_tokens"].to_numpy()
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": target, "logprobs": q, "advantages": adv}))  # fmt: skip
        qs.append(q)
        advs.append(adv)
    return out, qs, advs


def grads(server, slot: int) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in server.trainer._params[slot].parameters()]


def zero_grads(server, slot: int) -> None:
    for p in server.trainer._params[slot].parameters():
        p.grad = None


@pytest.mark.parametrize("name", RL)
def test_an_rl_forward_backward_through_the_sdk_matches_the_formula(server, name):
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    tc.forward_backward(examples(tc.get_tokenizer(), 2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # B != 0: every grad is live
    data = examples(tc.get_tokenizer(), 3, start=7)
    plain = tc.forward(data, "cross_entropy").result()
    logprobs = [o["logprobs"].to_numpy() for o in plain.loss_fn_outputs]
    rl, qs, advs = rl_data(data, logprobs)
    slot = server.slot_of(tc.model_id)
    config = CONFIG[name]
    result = tc.forward_backward(rl, name, config or None).result()
    served = grads(server, slot)
    zero_grads(server, slot)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    expected = sum(
        float(documented(name, torch.tensor(lp), torch.tensor(q), torch.tensor(a), low, high))
        for lp, q, a in zip(logprobs, qs, advs, strict=True)
    )
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    for out, lp in zip(result.loss_fn_outputs, logprobs, strict=True):
        np.testing.assert_array_equal(out["logprobs"].to_numpy(), lp)
    batch = direct_batch(data, slot)  # the same rows through the slot, the formula here
    length = batch["input_ids"].shape[1]
    for key, values in (("logprobs", qs), ("advantages", advs)):
        batch[key] = torch.zeros(len(data), length)
        for i, v in enumerate(values):
            batch[key][i, : v.shape[0]] = torch.tensor(v)

    def formula(logp: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return documented(name, logp, b["logprobs"], b["advantages"], low, high)

    forward_tokens(server.trainer, batch, formula, backward=True)
    direct = grads(server, slot)
    zero_grads(server, slot)
    assert any(bool(g.abs().sum() > 0) for g in direct)
    for a, b in zip(served, direct, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    sc.close("success").result()


def test_a_wrong_rl_input_shape_is_a_4xx_naming_the_field(server):
    sc = server.client("bob")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    (d,) = examples(tc.get_tokenizer(), 1)
    n = d.model_input.length
    target = d.loss_fn_inputs["target_tokens"].to_numpy()
    bad = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": target, "logprobs": np.zeros(n, np.float32),
        "advantages": np.ones(n + 2, np.float32)})  # fmt: skip
    with pytest.raises(tinker.APIStatusError) as caught:
        tc.forward_backward([bad], "importance_sampling").result()
    assert 400 <= caught.value.status_code < 500
    detail = json.dumps(caught.value.body)
    assert "advantages" in detail and "one value per input token" in detail
    with pytest.raises(tinker.APIStatusError, match="dro") as caught:
        tc.forward_backward([bad], "dro").result()
    assert 400 <= caught.value.status_code < 500
    sc.close("success").result()
