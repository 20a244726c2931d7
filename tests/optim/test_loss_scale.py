"""The dynamic loss scaler and the exact optimizers' FP32 unscaling of FP16 gradients.

The scaler halves on an overflow and counts the skip, doubles after ``growth_interval``
clean steps, refuses to go below its floor, and restores its state only when all of it is
valid. The optimizers divide loss-scaled FP16 gradients after widening them, so a step on
``grad * 2**k`` with ``grad_divisor=2**k`` is bitwise the step on ``grad``, and a gradient
that FP16 flushes to zero survives when it was scaled.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.helpers import HYPER, make_params, set_grads
from tests.optim.kinds import make_opt
from veoptim.errors import CheckpointError, ConfigError, DivergedError
from veoptim.optim import MASTER_WEIGHT
from veoptim.optim.loss_scale import MIN_SCALE, DynamicLossScaler

EXACT_KINDS = ("exact", "offload")


def test_overflow_halves_the_scale_and_counts_the_skipped_step():
    scaler = DynamicLossScaler(scale=2.0**16, growth_interval=3)
    scaler.update(found_inf=False, step=1)
    scaler.update(found_inf=True, step=2)
    assert scaler.state_dict() == {
        "scale": 2.0**15, "growth_interval": 3, "clean_steps": 0, "skipped_steps": 1
    }  # fmt: skip


def test_scale_doubles_after_growth_interval_clean_steps_in_a_row():
    scaler = DynamicLossScaler(scale=8.0, growth_interval=2)
    scales = []
    for found_inf in (False, True, False, False, False, False):
        scaler.update(found_inf=found_inf, step=len(scales) + 1)
        scales.append(scaler.scale)
    assert scales == [8.0, 4.0, 4.0, 8.0, 8.0, 16.0]
    assert scaler.skipped_steps == 1


def test_an_overflow_at_the_smallest_scale_is_divergence():
    scaler = DynamicLossScaler(scale=MIN_SCALE, growth_interval=2)
    with pytest.raises(DivergedError, match="fp16 step 7 overflowed .* smallest loss scale"):
        scaler.update(found_inf=True, step=7)


@pytest.mark.parametrize("scale", [3.0, 0.5, float("inf"), 0.0, True])
def test_a_first_scale_that_is_no_power_of_two_at_least_one_is_refused(scale):
    with pytest.raises(ConfigError, match="train.loss_scale_init must be a power of two"):
        DynamicLossScaler(scale=scale)


def test_state_round_trips_bitwise_through_json():
    import json

    scaler = DynamicLossScaler(scale=2.0**20, growth_interval=5)
    for found_inf in (False, True, False):
        scaler.update(found_inf=found_inf, step=1)
    restored = DynamicLossScaler(scale=1.0, growth_interval=5)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored == scaler


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"scale": 3.0}, "power of two"),
        ({"scale": 0.25}, "power of two"),
        ({"skipped_steps": -1}, "non-negative ints"),
        ({"clean_steps": 1.5}, "non-negative ints"),
        ({"growth_interval": 7}, "grows every 7 clean steps, this run's every 5"),
        ({"extra": 1}, "must have keys"),
    ],
)
def test_a_bad_saved_state_is_refused_and_changes_nothing(edit, message):
    scaler = DynamicLossScaler(scale=2.0**10, growth_interval=5)
    saved = {**scaler.state_dict(), "clean_steps": 2, **edit}
    before = copy.deepcopy(scaler)
    with pytest.raises(CheckpointError, match=message):
        scaler.load_state_dict(saved)
    assert scaler == before


def _state(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_scaled_fp16_gradients_divided_in_fp32_step_bitwise_like_unscaled_ones(kind):
    """A power-of-two scale is exact in FP16 (no overflow, no underflow here) and in FP32,
    so the divided gradient is the gradient: every master, moment and parameter equal."""
    plain, scaled = make_params(torch.float16), make_params(torch.float16)
    opt_plain = make_opt(kind, plain, **HYPER)
    opt_scaled = make_opt(kind, scaled, **HYPER)
    for step in range(4):
        set_grads(plain, step, torch.float16)
        for p, q in zip(plain, scaled, strict=True):
            q.grad = p.grad * 2.0**4  # exact: the largest stays far below FP16's 65504
        opt_plain.step()
        opt_scaled.step(grad_divisor=2.0**4)
    for p, q in zip(plain, scaled, strict=True):
        assert torch.equal(p, q)
    for a, b in zip(_state(opt_plain, plain), _state(opt_scaled, scaled), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_a_gradient_fp16_flushes_to_zero_survives_when_scaled(kind):
    """2e-8 is below FP16's smallest subnormal/2: stored as is it is 0 and the master
    stays; scaled by 2**16 it is stored, and divided in FP32 it moves the master."""
    tiny = 2e-8
    assert torch.tensor(tiny).half().item() == 0.0
    results = {}
    for scale in (1.0, 2.0**16):
        (p,) = [torch.nn.Parameter(torch.ones(64, dtype=torch.float16))]
        opt = make_opt(kind, [p], lr=1e-3, weight_decay=0.0)
        p.grad = torch.full((64,), tiny * scale).half()
        opt.step(grad_divisor=scale)
        results[scale] = opt.state[p]
    assert torch.equal(results[1.0][MASTER_WEIGHT], torch.ones(64))
    moved = results[2.0**16]
    assert (moved[MASTER_WEIGHT] < 1).all()
    torch.testing.assert_close(moved["exp_avg"], torch.full((64,), 0.1 * tiny), rtol=1e-3, atol=0)


@pytest.mark.parametrize("divisor", [0.0, -2.0, float("inf"), float("nan")])
def test_a_gradient_divisor_must_be_positive_and_finite(divisor):
    params = make_params(torch.float16)
    opt = make_opt("exact", params, **HYPER)
    set_grads(params, 0, torch.float16)
    with pytest.raises(ConfigError, match="'grad_divisor' must be positive and finite"):
        opt.step(grad_divisor=divisor)
    assert not opt.state  # nothing was created or changed
