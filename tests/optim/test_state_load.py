"""Loading optimizer state: validate before mutation, never cast, no copies, exact next step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.profiler import ProfilerActivity, profile

from tests.optim.helpers import HYPER, make_params, set_grads
from veoptim.errors import CheckpointError
from veoptim.optim import (
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_WEIGHT,
    STEP,
    AdamW,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
    dcp_state_init,
    expected_optimizer_state,
)

FACTORIES = {
    "adamw": lambda g: AdamW(g, fused=True, **HYPER),
    "full_fp32_adamw": lambda g: FullFP32AdamW(g, **HYPER),
    "master_fp32_adamw": lambda g: MasterFP32AdamW(g, **HYPER),
    "cpu_offload_adamw": lambda g: CPUOffloadAdamW(
        [{**g[0], "cpu_offload": True}], chunk_size=128, **HYPER
    ),
}


def _train(name: str, dtype: torch.dtype, steps: int, start: int = 0, state=None):
    params = make_params(dtype)
    opt = FACTORIES[name]([{"params": params}])
    if state is not None:
        params_sd, opt_sd = state
        with torch.no_grad():
            for p, v in zip(params, params_sd, strict=True):
                p.copy_(v)
        opt.load_state_dict(opt_sd)
    for step in range(start, start + steps):
        set_grads(params, step, dtype)
        opt.step()
    return params, opt


def _get_osd(model, opt):
    """DCP's get_optimizer_state_dict inside the marker that makes its init step a dummy."""
    with dcp_state_init(opt):
        return get_optimizer_state_dict(model, opt)


def _set_osd(model, opt, sd) -> None:
    with dcp_state_init(opt):
        set_optimizer_state_dict(model, opt, sd)


def _snapshot(params, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        for key in sorted(opt.state[p]):
            out.append(opt.state[p][key].detach().clone())
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_dict_round_trip_reproduces_next_steps_bitwise(name, dtype):
    params, opt = _train(name, dtype, 4)
    saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    for step in range(4, 6):
        set_grads(params, step, dtype)
        opt.step()
    resumed_params, resumed = _train(name, dtype, 2, start=4, state=saved)
    assert _same(_snapshot(params, opt), _snapshot(resumed_params, resumed))


def _corrupt(sd: dict, key: str, fn) -> dict:
    bad = copy.deepcopy(sd)
    entry = bad["state"][1]
    entry[key] = fn(entry[key])
    return bad


CORRUPTIONS = {
    "moment dtype": (EXP_AVG, lambda t: t.to(torch.float16), "never cast"),
    "master dtype": (MASTER_WEIGHT, lambda t: t.to(torch.bfloat16), "never cast"),
    "second moment dtype": (EXP_AVG_SQ, lambda t: t.to(torch.float64), "never cast"),
    "step dtype": (STEP, lambda t: t.to(torch.float64), "never cast"),
    "shape": (EXP_AVG, lambda t: t[:-1], "local shape"),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_mismatched_state_is_rejected_before_anything_changes(name, case):
    key, fn, message = CORRUPTIONS[case]
    if name == "adamw" and key == MASTER_WEIGHT:
        pytest.skip("torch AdamW has no master weight")
    params, opt = _train(name, torch.bfloat16, 3)
    bad = _corrupt(opt.state_dict(), key, fn)
    # The corrupted entry is the second one: the first entry would be installed by a
    # loader that validates lazily, so "nothing changed" also catches partial loads.
    bad["state"][0] = {k: (v.clone() + 1 if k != STEP else v) for k, v in bad["state"][0].items()}
    before = _snapshot(params, opt)
    groups_before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    bad["param_groups"][0]["lr"] = 123.0
    with pytest.raises(CheckpointError, match=message):
        opt.load_state_dict(bad)
    assert _same(before, _snapshot(params, opt))
    assert groups_before == [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_missing_and_unexpected_state_keys_are_rejected(name):
    params, opt = _train(name, torch.bfloat16, 2)
    sd = opt.state_dict()
    missing = copy.deepcopy(sd)
    del missing["state"][0][EXP_AVG_SQ]
    with pytest.raises(CheckpointError, match="missing"):
        opt.load_state_dict(missing)
    extra = copy.deepcopy(sd)
    extra["state"][0]["max_exp_avg_sq"] = extra["state"][0][EXP_AVG].clone()
    with pytest.raises(CheckpointError, match="unexpected"):
        opt.load_state_dict(extra)


def test_param_group_size_mismatch_is_rejected():
    params, opt = _train("full_fp32_adamw", torch.bfloat16, 1)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    with pytest.raises(CheckpointError, match="parameters in the state dict"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("name", ["full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw"])
def test_load_installs_fp32_state_without_parameter_dtype_copies(name):
    params, opt = _train(name, torch.bfloat16, 2)
    sd = copy.deepcopy(opt.state_dict())
    fresh_params = make_params(torch.bfloat16)
    fresh = FACTORIES[name]([{"params": fresh_params}])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fresh.load_state_dict(sd)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated == 0
    for i, p in enumerate(fresh_params):
        for key in (MASTER_WEIGHT, EXP_AVG, EXP_AVG_SQ):
            assert fresh.state[p][key].data_ptr() == sd["state"][i][key].data_ptr()
        assert fresh.state[p][MASTER_WEIGHT].dtype == torch.float32


def test_torch_optimizer_loader_would_make_bf16_copies():
    """Negative control for the test above: torch's own loader casts FP32 state to BF16."""
    params, opt = _train("full_fp32_adamw", torch.bfloat16, 2)
    sd = copy.deepcopy(opt.state_dict())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.optim.Optimizer.load_state_dict(opt, sd)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated >= 3 * 2 * sum(p.numel() for p in params)
    assert opt.state[params[0]][MASTER_WEIGHT].dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_expected_optimizer_state_matches_the_state_after_a_step(name):
    params, opt = _train(name, torch.bfloat16, 1)
    for p in params:
        expected = expected_optimizer_state(opt, p)
        state = opt.state[p]
        assert set(expected) == set(state)
        for key, (shape, dtype) in expected.items():
            assert (state[key].shape, state[key].dtype) == (shape, dtype)


class _Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(make_params(dtype))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_dcp_dummy_step_is_not_a_real_step(name):
    dtype = torch.bfloat16
    net, plain = _Net(dtype), _Net(dtype)
    opt = FACTORIES[name]([{"params": list(net.parameters())}])
    ref = FACTORIES[name]([{"params": list(plain.parameters())}])
    sd = _get_osd(net, opt)  # runs DCP's zero-grad, lr=0 "dummy" step
    assert all(float(v[STEP]) == 0.0 for v in sd["state"].values())
    assert len(sd["state"]) == len(list(net.parameters()))
    assert all(p.grad is None for p in net.parameters())
    for step in range(3):
        set_grads(list(net.parameters()), step, dtype)
        set_grads(list(plain.parameters()), step, dtype)
        opt.step()
        ref.step()
    assert _same(_snapshot(list(net.parameters()), opt), _snapshot(list(plain.parameters()), ref))
    assert float(opt.state[next(net.parameters())][STEP]) == 3.0


def test_torch_adamw_counts_the_dcp_dummy_step():
    """Negative control: unmodified torch.optim.AdamW records the dummy step as step 1."""
    net = _Net(torch.float32)
    opt = torch.optim.AdamW(net.parameters(), **HYPER)
    sd = _get_osd(net, opt)
    assert all(float(v[STEP]) == 1.0 for v in sd["state"].values())


@pytest.mark.parametrize("name", ["full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw"])
def test_placeholder_master_follows_weights_loaded_after_it(name):
    """State made by the dummy step is re-derived from the parameter at the first real step."""
    net = _Net(torch.bfloat16)
    opt = FACTORIES[name]([{"params": list(net.parameters())}])
    _get_osd(net, opt)
    new_weights = make_params(torch.bfloat16, seed=7)
    with torch.no_grad():
        for p, w in zip(net.parameters(), new_weights, strict=True):
            p.copy_(w)
    ref = FACTORIES[name]([{"params": new_weights}])
    set_grads(list(net.parameters()), 0, torch.bfloat16)
    set_grads(new_weights, 0, torch.bfloat16)
    opt.step()
    ref.step()
    assert _same(_snapshot(list(net.parameters()), opt), _snapshot(new_weights, ref))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_dcp_round_trip_reproduces_next_step_bitwise(name):
    dtype = torch.bfloat16
    net = _Net(dtype)
    opt = FACTORIES[name]([{"params": list(net.parameters())}])
    for step in range(3):
        set_grads(list(net.parameters()), step, dtype)
        opt.step()
    saved_params = [p.detach().clone() for p in net.parameters()]
    saved = copy.deepcopy(_get_osd(net, opt))
    set_grads(list(net.parameters()), 3, dtype)
    opt.step()
    fresh = _Net(dtype)
    with torch.no_grad():
        for p, v in zip(fresh.parameters(), saved_params, strict=True):
            p.copy_(v)
    fresh_opt = FACTORIES[name]([{"params": list(fresh.parameters())}])
    _set_osd(fresh, fresh_opt, saved)
    set_grads(list(fresh.parameters()), 3, dtype)
    fresh_opt.step()
    assert _same(
        _snapshot(list(net.parameters()), opt), _snapshot(list(fresh.parameters()), fresh_opt)
    )


@pytest.mark.parametrize("name", ["full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw"])
def test_frozen_then_unfrozen_parameter_gets_fresh_state_at_first_gradient(name):
    dtype = torch.bfloat16
    params = make_params(dtype)
    frozen = params[1]
    frozen.requires_grad_(False)
    opt = FACTORIES[name]([{"params": params}])
    active = [p for p in params if p is not frozen]
    for step in range(3):
        set_grads(active, step, dtype)
        opt.step()
    assert not opt.state[frozen]
    # DCP round trip while frozen: the frozen parameter has no state to save or load.
    net = torch.nn.Module()
    net.params = torch.nn.ParameterList(params)
    sd = _get_osd(net, opt)
    _set_osd(net, opt, copy.deepcopy(sd))
    with torch.no_grad():
        frozen.add_(1.0)  # e.g. weights changed while frozen
    frozen.requires_grad_(True)
    ref_param = torch.nn.Parameter(frozen.detach().clone())
    ref = FACTORIES[name]([{"params": [ref_param]}])
    set_grads(params, 3, dtype)
    ref_param.grad = frozen.grad.clone()
    opt.step()
    ref.step()
    assert float(opt.state[frozen][STEP]) == 1.0
    assert _same(_snapshot([frozen], opt), _snapshot([ref_param], ref))


#: The exact optimizers (FP32 masters), built with parameter names as the trainer builds them.
EXACT_FACTORIES = {
    "full_fp32_adamw": lambda g, names: FullFP32AdamW(g, param_names=names, **HYPER),
    "master_fp32_adamw": lambda g, names: MasterFP32AdamW(g, param_names=names, **HYPER),
    "cpu_offload_adamw": lambda g, names: CPUOffloadAdamW(
        [{**g[0], "cpu_offload": True}], chunk_size=128, param_names=names, **HYPER
    ),
}
RESHAPES = {
    "transposed": lambda t: t.t().contiguous(),
    "flattened": lambda t: t.reshape(-1).clone(),
}


@pytest.mark.parametrize("name", sorted(EXACT_FACTORIES))
@pytest.mark.parametrize("key", [EXP_AVG, EXP_AVG_SQ, MASTER_WEIGHT])
@pytest.mark.parametrize("reshape", sorted(RESHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_state_of_the_right_size_but_another_shape_is_refused(name, key, reshape, dtype):
    """A moment or master of a non-square weight, transposed or flattened (same element
    count), handed to load_state_dict directly: refused naming the parameter, the key and
    both shapes, and nothing of the optimizer or the parameters changes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in [(64,), (37, 29)]]
    names = {id(params[0]): "model.norm.weight", id(params[1]): "model.proj.weight"}
    opt = EXACT_FACTORIES[name]([{"params": params}], names)
    for step in range(2):
        set_grads(params, step, dtype)
        opt.step()
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0] = {k: (v + 1 if k != STEP else v) for k, v in bad["state"][0].items()}
    original = bad["state"][1][key]
    assert original.shape == (37, 29)
    bad["state"][1][key] = RESHAPES[reshape](original)
    found = tuple(bad["state"][1][key].shape)
    assert found != (37, 29) and bad["state"][1][key].numel() == original.numel()
    before = _snapshot(params, opt)
    with pytest.raises(CheckpointError) as info:
        opt.load_state_dict(bad)
    message = str(info.value)
    assert f"{key!r} of model.proj.weight" in message, message
    assert f"shape {found}, expected (37, 29)" in message, message
    assert _same(before, _snapshot(params, opt))
    # The refused load left the optimizer usable: its next step equals an untouched copy's.
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = EXACT_FACTORIES[name]([{"params": twin_params}], {})
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    set_grads(params, 2, dtype)
    set_grads(twin_params, 2, dtype)
    opt.step()
    twin.step()
    assert _same(_snapshot(params, opt), _snapshot(twin_params, twin))
