"""Parameter edits between steps are followed by the optimizer, never silently undone.

The probe is a step with lr 0 and weight decay 0: it leaves the FP32 master as it
is and writes the parameter from it, so the parameter after the step shows which
value the master holds: the edited one (followed) or the stale one (reverted).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.optim.kinds import DTYPES, KINDS, batch, linear, loss_of, make_opt, same, snapshot, train
from veoptim.optim import MASTER_WEIGHT, CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW

HYPER = dict(lr=1e-2, weight_decay=0.1)
#: Where the master is a separate tensor, or the parameter itself (exact FP32 resident).
CASES = [(k, d) for k in KINDS for d in DTYPES]


def _probe_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int = 7) -> None:
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    opt.zero_grad()
    loss_of(model, batch(seed, next(model.parameters()).dtype)).backward()
    opt.step()


def _trained(kind: str, dtype: torch.dtype, **kw):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **{**HYPER, **kw})
    train(model, opt, range(3))
    return model, opt


EDITS = {
    "load_state_dict": lambda m, snap: m.load_state_dict(snap),
    "no_grad clamp_": lambda m, snap: [p.clamp_(-0.01, 0.01) for p in _no_grad(m)],
    "reset_parameters": lambda m, snap: (torch.manual_seed(3), m.reset_parameters()),
    "detach().mul_": lambda m, snap: [p.detach().mul_(0.5) for p in m.parameters()],
}


def _no_grad(m: torch.nn.Module):
    with torch.no_grad():
        yield from m.parameters()


@pytest.mark.parametrize("kind, dtype", CASES)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_in_place_edit_between_steps_is_kept(kind, dtype, edit, caplog):
    initial = copy.deepcopy(linear(dtype).state_dict())
    model, opt = _trained(kind, dtype)
    EDITS[edit](model, initial)
    edited = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger="veoptim.optim"):
        _probe_step(model, opt)
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), edited, strict=True))
    if kind != "adamw":
        for p in model.parameters():
            assert torch.equal(opt.state[p][MASTER_WEIGHT], p.float())
    separate_master = kind == "offload" or (kind == "exact" and dtype != torch.float32)
    assert ("changed outside the optimizer" in caplog.text) == separate_master


@pytest.mark.parametrize("kind, dtype", CASES)
def test_rebinding_p_data_is_followed_not_frozen(kind, dtype, caplog):
    model, opt = _trained(kind, dtype)
    new = [torch.full_like(p, 0.25) for p in model.parameters()]
    for p, v in zip(model.parameters(), new, strict=True):
        p.data = v
    with caplog.at_level(logging.INFO, logger="veoptim.optim"):
        _probe_step(model, opt)
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())
    for g in opt.param_groups:
        g["lr"] = 1e-2
    train(model, opt, range(3, 5))  # the parameter moves again: it is not frozen
    for p in model.parameters():
        assert not torch.equal(p, torch.full_like(p, 0.25))
        if kind != "adamw":
            assert torch.equal(opt.state[p][MASTER_WEIGHT].to(dtype), p)
    assert ("changed outside the optimizer" in caplog.text) == (kind != "adamw")


@pytest.mark.parametrize("kind, dtype", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_writes_of_identical_values_change_nothing(kind, dtype, stochastic, caplog):
    """A resume-style reload of the very same weights keeps the run bitwise and quiet."""
    if stochastic and kind == "adamw":
        pytest.skip("stochastic rounding is an option of the exact types")
    kw = {"stochastic_rounding": True, "sr_seed": 3} if stochastic else {}
    model, opt = _trained(kind, dtype, **kw)
    control, control_opt = _trained(kind, dtype, **kw)
    with caplog.at_level(logging.INFO, logger="veoptim.optim"):
        model.load_state_dict(copy.deepcopy(model.state_dict()))
        train(model, opt, range(3, 6))
    train(control, control_opt, range(3, 6))
    assert same(snapshot(model, opt), snapshot(control, control_opt))
    assert "changed outside the optimizer" not in caplog.text


@pytest.mark.parametrize("cls", [FullFP32AdamW, MasterFP32AdamW, CPUOffloadAdamW])
def test_edits_through_p_data_are_picked_up_by_resync_masters(cls):
    """``p.data`` has its own version counter; resync_masters() is the explicit way."""
    model = linear(torch.bfloat16)
    groups = [{"params": list(model.parameters()), "cpu_offload": cls is CPUOffloadAdamW}]
    opt = cls(groups, **HYPER)
    train(model, opt, range(2))
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)
    assert len(opt.resync_masters()) == 2
    assert opt.resync_masters() == []
    _probe_step(model, opt)
    assert all(bool((p.abs() <= 0.01).all()) for p in model.parameters())
