"""PyTorch's own optimizer test cases, ported to veoptim's three optimizer classes.

After ``test/test_optim.py`` and ``torch/testing/_internal/common_optimizers.py``:
closures, state-dict round trips (also through ``torch.save``/``weights_only``),
step and state-dict hooks, LR schedulers (also a tensor LR), several param
groups, determinism, ``zero_grad``, parameters without gradients. Where the
arithmetic is torch's, the reference is ``torch.optim.AdamW(fused=True)``: bitwise
for ``adamw`` in any dtype, and for the FP32 masters of ``exact``/``offload`` fed
the same (upcast) gradients. Deliberate differences are asserted as such at the end.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.optim.kinds import DTYPES, KINDS, batch, linear, loss_of, make_opt, same, snapshot, train
from veoptim.errors import CheckpointError, ConfigError
from veoptim.optim import MASTER_WEIGHT, STEP, AdamW, CPUOffloadAdamW, ExactAdamW

pytestmark = [pytest.mark.parametrize("kind", KINDS)]
DEFAULTS = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)


def _copy_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_with_closure_calls_it_once_and_returns_its_loss(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    before = [p.detach().clone() for p in model.parameters()]
    calls: list[torch.Tensor] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model, batch(0, dtype))
        loss.backward()
        calls.append(loss)
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and loss is calls[0]
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert opt.step() is None  # without a closure, step returns None (torch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_round_trip_into_a_fresh_optimizer_steps_bitwise(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    train(model, opt, range(3))
    saved_model, saved = _copy_model(model), copy.deepcopy(opt.state_dict())
    fresh_opt = make_opt(kind, saved_model.parameters(), **DEFAULTS)
    fresh_opt.load_state_dict(saved)
    # state_dict of the loaded optimizer equals the saved one (torch: test_state_dict_deterministic)
    reloaded = fresh_opt.state_dict()
    assert reloaded["param_groups"] == saved["param_groups"]
    for key, entry in saved["state"].items():
        assert same(
            [entry[k] for k in sorted(entry)], [reloaded["state"][key][k] for k in sorted(entry)]
        )
    train(model, opt, range(3, 6))
    train(saved_model, fresh_opt, range(3, 6))
    assert same(snapshot(model, opt), snapshot(saved_model, fresh_opt))


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_survives_torch_save_with_weights_only(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    train(model, opt, range(2))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twin = _copy_model(model)
    twin_opt = make_opt(kind, twin.parameters(), **DEFAULTS)
    twin_opt.load_state_dict(loaded)
    train(model, opt, range(2, 4))
    train(twin, twin_opt, range(2, 4))
    assert same(snapshot(model, opt), snapshot(twin, twin_opt))


def test_step_pre_and_post_hooks_run_in_order_and_can_be_removed(kind):
    model = linear(torch.float32)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    events: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: events.append("pre"))
    post = opt.register_step_post_hook(lambda o, args, kwargs: events.append("post"))
    train(model, opt, range(2))
    assert events == ["pre", "post", "pre", "post"]
    pre.remove()
    post.remove()
    train(model, opt, range(2, 3))
    assert events == ["pre", "post", "pre", "post"]


def test_state_dict_hooks_see_and_may_change_the_state_dict(kind):
    model = linear(torch.float32)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    train(model, opt, range(1))
    events: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: events.append("sd_pre"))

    def post(o, sd):
        events.append("sd_post")
        sd["param_groups"][0]["note"] = "from post hook"
        return sd

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert events == ["sd_pre", "sd_post"] and sd["param_groups"][0]["note"] == "from post hook"

    def load_pre(o, sd):
        events.append("load_pre")
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.5
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: events.append("load_post"))
    opt.load_state_dict(sd)
    assert events[2:] == ["load_pre", "load_post"]
    assert opt.param_groups[0]["lr"] == 0.5


def test_load_pre_hook_runs_before_validation(kind):
    """torch runs load pre-hooks first; a hook that repairs a state dict must be honoured."""
    model = linear(torch.float32)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    train(model, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["legacy_key"] = torch.zeros(())

    def drop_legacy(o, state_dict):
        state_dict = copy.copy(state_dict)
        state_dict["state"] = {
            k: {n: v for n, v in e.items() if n != "legacy_key"}
            for k, e in state_dict["state"].items()
        }
        return state_dict

    with pytest.raises(CheckpointError, match="unexpected"):
        opt.load_state_dict(sd)
    opt.register_load_state_dict_pre_hook(drop_legacy)
    opt.load_state_dict(sd)
    assert all("legacy_key" not in s for s in opt.state.values())


def _against_torch(kind, dtype, groups, steps, sched=None, **defaults):
    """Run ``kind`` and torch's fused AdamW on copies (FP32 copies for exact types) with equal grads."""
    model = linear(dtype)
    params = list(model.parameters())
    ref_dtype = dtype if kind == "adamw" else torch.float32
    ref = [torch.nn.Parameter(p.detach().clone().to(ref_dtype)) for p in params]
    opt = make_opt(
        kind, [{**g, "params": [params[i] for i in g["params"]]} for g in groups], **defaults
    )
    ref_opt = torch.optim.AdamW(
        [{**g, "params": [ref[i] for i in g["params"]]} for g in groups], fused=True, **defaults
    )
    scheds = [sched(opt), sched(ref_opt)] if sched else []
    for s in range(steps):
        opt.zero_grad()
        loss_of(model, batch(s, dtype)).backward()
        for p, r in zip(params, ref, strict=True):
            r.grad = p.grad.to(ref_dtype)
        opt.step()
        ref_opt.step()
        for sc in scheds:
            sc.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    for p, r in zip(params, ref, strict=True):
        if kind == "adamw":
            assert torch.equal(p, r)
        else:
            assert torch.equal(opt.state[p][MASTER_WEIGHT], r)
            assert torch.equal(p, r.to(dtype))
    return opt


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_drive_the_update_exactly_like_torch(kind, dtype, name):
    _against_torch(kind, dtype, [{"params": [0, 1]}], 6, SCHEDULERS[name], **DEFAULTS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_lr_with_a_scheduler(kind, dtype):
    sched = lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7)  # noqa: E731
    opt = _against_torch(
        kind, dtype, [{"params": [0, 1]}], 5, sched, **{**DEFAULTS, "lr": torch.tensor(0.02)}
    )
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.parametrize("dtype", DTYPES)
def test_param_groups_with_different_hyperparameters(kind, dtype):
    groups = [
        {"params": [0], "lr": 3e-2, "betas": (0.8, 0.99), "weight_decay": 0.0},
        {"params": [1], "lr": 5e-3, "eps": 1e-6, "weight_decay": 0.2, "maximize": True},
    ]
    _against_torch(kind, dtype, groups, 4, **DEFAULTS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_inputs_give_bitwise_same_results(kind, dtype):
    runs = []
    for _ in range(2):
        model = linear(dtype)
        opt = make_opt(kind, model.parameters(), **DEFAULTS)
        train(model, opt, range(4))
        runs.append(snapshot(model, opt))
    assert same(*runs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_grad_sets_none_by_default_and_a_step_without_grads_is_a_no_op(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    train(model, opt, range(2))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = snapshot(model, opt)
    opt.step()
    assert same(before, snapshot(model, opt))
    loss_of(model, batch(9, dtype)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_zero_grads_are_a_real_step_like_torch(kind):
    """Zero (not None) gradients: the step counts and weight decay applies, as in torch."""
    groups = [{"params": [0, 1]}]
    model = linear(torch.float32)
    params = list(model.parameters())
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = make_opt(kind, params, **DEFAULTS)
    ref_opt = torch.optim.AdamW(ref, fused=True, **DEFAULTS)
    for p, r in zip(params, ref, strict=True):
        p.grad, r.grad = torch.zeros_like(p), torch.zeros_like(r)
    opt.step()
    ref_opt.step()
    assert groups and all(torch.equal(p, r) for p, r in zip(params, ref, strict=True))
    assert all(
        float(opt.state[p][STEP]) == float(ref_opt.state[r][STEP]) == 1.0
        for p, r in zip(params, ref, strict=True)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_parameters_without_gradient_are_skipped(kind, dtype):
    model = torch.nn.Sequential(linear(dtype), linear(dtype, seed=1, n_in=17, n_out=5))
    frozen, no_grad_yet = model[0].weight, model[1].bias
    frozen.requires_grad_(False)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    for s in range(2):
        opt.zero_grad()
        loss_of(model, batch(s, dtype)).backward()
        no_grad_yet.grad = None
        opt.step()
    for p in (frozen, no_grad_yet):
        assert torch.equal(p, before[id(p)]) and not opt.state.get(p)
    for p in (model[0].bias, model[1].weight):
        assert not torch.equal(p, before[id(p)]) and float(opt.state[p][STEP]) == 2.0


def test_optimizer_can_be_printed(kind):
    opt = make_opt(kind, linear(torch.float32).parameters(), **DEFAULTS)
    text = repr(opt)
    assert type(opt).__name__ in text and "lr: 0.01" in text


# ---------------------------------------------------------------- deliberate differences
def test_documented_differences_from_torch(kind):
    """amsgrad is rejected everywhere; exact types also reject complex parameters and
    torch's capturable/differentiable options (FP32-master arithmetic has no such modes)."""
    params = list(linear(torch.float32).parameters())
    with pytest.raises(ConfigError, match="amsgrad"):
        make_opt(kind, params, amsgrad=True)
    torch.optim.AdamW(params, amsgrad=True)  # torch accepts it
    if kind == "adamw":
        return
    with pytest.raises(ConfigError, match="dtype"):
        make_opt(kind, [torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(TypeError):
        make_opt(kind, params, differentiable=True)
    cls = CPUOffloadAdamW if kind == "offload" else ExactAdamW
    assert issubclass(cls, ExactAdamW) and not issubclass(cls, AdamW)


def test_step_hooks_run_once_even_after_a_plain_torch_adamw_exists(kind):
    """torch wraps ``step`` of each optimizer class it instantiates; ours must not run hooks twice."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    model = linear(torch.float32)
    opt = make_opt(kind, model.parameters(), **DEFAULTS)
    events: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: events.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: events.append("post"))
    train(model, opt, range(1))
    assert events == ["pre", "post"]
