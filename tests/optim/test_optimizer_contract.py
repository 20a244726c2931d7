"""torch.compile, deepcopy/pickle, validated add_param_group and arguments, DCP's marked
init step, tensor LRs, and refusal of never-stepped state that contradicts the model."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.optim.kinds import DTYPES, KINDS, batch, linear, loss_of, make_opt, same, snapshot, train
from veoptim.errors import CheckpointError, ConfigError
from veoptim.optim import (
    EXP_AVG,
    MASTER_WEIGHT,
    STEP,
    AdamW,
    CPUOffloadAdamW,
    ExactAdamW,
    dcp_state_init,
)

HYPER = dict(lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_training_step_with_optimizer_step_runs_like_eager(kind, backend):
    torch._dynamo.reset()
    dtype = torch.bfloat16
    compiled_model, eager_model = linear(dtype), linear(dtype)
    opt = make_opt(kind, compiled_model.parameters(), **HYPER)
    eager_opt = make_opt(kind, eager_model.parameters(), **HYPER)

    def train_step(model, optimizer, x):
        loss = loss_of(model, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    compiled = torch.compile(train_step, backend=backend)
    for s in range(3):
        compiled(compiled_model, opt, batch(s, dtype))
        train_step(eager_model, eager_opt, batch(s, dtype))
    assert same(snapshot(compiled_model, opt), snapshot(eager_model, eager_opt))


# ---------------------------------------------------------------- deepcopy / pickle
def _configured(kind: str):
    model = linear(torch.bfloat16)
    if kind == "adamw":
        return model, AdamW(
            model.parameters(), fused=True, param_names={id(model.weight): "w"}, **HYPER
        )
    groups = [
        {"params": [model.weight], "cpu_offload": kind == "offload"},
        {"params": [model.bias]},
    ]
    cls = CPUOffloadAdamW if kind == "offload" else ExactAdamW
    opt = cls(
        groups,
        resident_moment_dtype=torch.bfloat16,
        offload_moment_dtype=torch.bfloat16,
        stochastic_rounding=True,
        sr_seed=11,
        chunk_size=64,
        fused_chunk_size=128,
        param_names={id(model.weight): "w"},
        **HYPER,
    )
    return model, opt


SETTINGS = (
    "resident_moment_dtype",
    "offload_moment_dtype",
    "stochastic_rounding",
    "sr_seed",
    "chunk_size",
    "fused_chunk_size",
)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", KINDS)
def test_copies_keep_every_setting_and_step_bitwise_like_the_original(kind, how):
    model, opt = _configured(kind)
    train(model, opt, range(2))
    if how == "deepcopy":
        twin_model, twin = copy.deepcopy((model, opt))
    else:
        twin_model, twin = pickle.loads(pickle.dumps((model, opt)))
    for name in SETTINGS if kind != "adamw" else ():
        assert getattr(twin, name) == getattr(opt, name), name
    assert twin.param_names == {id(twin_model.weight): "w"}
    train(model, opt, range(2, 5))
    train(twin_model, twin, range(2, 5))
    assert same(snapshot(model, opt), snapshot(twin_model, twin))


# ---------------------------------------------------------------- add_param_group
@pytest.mark.parametrize("kind", KINDS)
def test_rejected_param_group_is_not_added(kind):
    model = linear(torch.float32)
    opt = make_opt(kind, [model.weight], **HYPER)
    bad = (
        {"params": [model.bias], "lr": torch.tensor([0.1, 0.2])}
        if kind == "adamw"
        else {"params": [torch.nn.Parameter(torch.zeros(4, 6).t())]}
    )
    with pytest.raises(ValueError):
        opt.add_param_group(bad)
    assert len(opt.param_groups) == 1
    train(model, opt, range(2))  # the next step works


def test_offload_group_with_meta_parameters_is_refused_at_construction():
    meta = torch.nn.Parameter(torch.empty(8, device="meta"))
    with pytest.raises(ConfigError, match="meta"):
        CPUOffloadAdamW([{"params": [meta], "cpu_offload": True}])
    opt = CPUOffloadAdamW([{"params": [torch.nn.Parameter(torch.zeros(8))]}])
    with pytest.raises(ConfigError, match="meta"):
        opt.add_param_group({"params": [meta], "cpu_offload": True})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- DCP's init step
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_real_zero_lr_zero_grad_first_step_counts_like_torch(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), lr=0.0)
    ref = torch.optim.AdamW(
        [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()], lr=0.0
    )
    for p in (*model.parameters(), *ref.param_groups[0]["params"]):
        p.grad = torch.zeros_like(p)
    opt.step()
    ref.step()
    assert [float(opt.state[p][STEP]) for p in model.parameters()] == [1.0, 1.0]
    assert all(float(s[STEP]) == 1.0 for s in ref.state.values())


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_init_step_inside_the_marker_is_not_counted(kind):
    model = linear(torch.bfloat16)
    opt = make_opt(kind, model.parameters(), **HYPER)
    with dcp_state_init(opt):
        sd = get_optimizer_state_dict(model, opt)
    assert len(sd["state"]) == 2 and all(float(v[STEP]) == 0.0 for v in sd["state"].values())
    train(model, opt, range(1))
    assert all(float(opt.state[p][STEP]) == 1.0 for p in model.parameters())


# ---------------------------------------------------------------- tensor LR, arguments
@pytest.mark.parametrize("kind", KINDS)
def test_multi_element_tensor_lr_gets_torchs_error(kind):
    params = list(linear(torch.float32).parameters())
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        torch.optim.AdamW(params, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make_opt(kind, params, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make_opt(kind, [{"params": params, "lr": torch.tensor([1e-3, 1e-3])}])


BAD_EXACT = {
    "cpu_offload string": ({"cpu_offload": "false"}, {}, "cpu_offload"),
    "stochastic_rounding string": ({}, {"stochastic_rounding": "yes"}, "stochastic_rounding"),
    "maximize int": ({}, {"maximize": 1}, "maximize"),
    "group maximize string": ({"maximize": "False"}, {}, "maximize"),
    "moment dtype fp16": ({}, {"resident_moment_dtype": torch.float16}, "resident_moment_dtype"),
    "moment dtype name": ({}, {"offload_moment_dtype": "bf16"}, "offload_moment_dtype"),
    "chunk_size zero": ({}, {"chunk_size": 0}, "chunk_size"),
    "chunk_size float": ({}, {"chunk_size": 1.5}, "chunk_size"),
    "chunk_size bool": ({}, {"fused_chunk_size": True}, "fused_chunk_size"),
    "sr_seed string": ({}, {"sr_seed": "1"}, "sr_seed"),
    "lr string": ({}, {"lr": "1e-3"}, "lr"),
    "betas one value": ({}, {"betas": (0.9,)}, "betas"),
}


@pytest.mark.parametrize("case", sorted(BAD_EXACT))
def test_exact_optimizers_validate_their_arguments(case):
    group_kw, kw, option = BAD_EXACT[case]
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ConfigError, match=option):
        CPUOffloadAdamW([{"params": params, **group_kw}], **kw)


@pytest.mark.parametrize("option", ["maximize", "foreach", "fused", "capturable", "differentiable"])
def test_adamw_boolean_options_must_be_booleans(option):
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ConfigError, match=option):
        AdamW(params, **{option: "false"})


# ---------------------------------------------------------------- never-stepped state
def _step0_state(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    with dcp_state_init(opt):
        get_optimizer_state_dict(model, opt)
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_step0_state_that_contradicts_the_live_parameter_is_rejected(kind, dtype):
    model = linear(dtype)
    opt = make_opt(kind, model.parameters(), **HYPER)
    sd = _step0_state(kind, model, opt)
    fresh_model = linear(dtype)
    fresh = make_opt(kind, fresh_model.parameters(), **HYPER)
    fresh.load_state_dict(copy.deepcopy(sd))  # consistent: accepted
    before = snapshot(fresh_model, fresh)
    moments = copy.deepcopy(sd)
    moments["state"][1][EXP_AVG].fill_(0.5)
    with pytest.raises(CheckpointError, match="step is 0"):
        fresh.load_state_dict(moments)
    if kind != "adamw":
        other = copy.deepcopy(sd)
        other["state"][0][MASTER_WEIGHT].add_(1.0)
        with pytest.raises(CheckpointError, match="differs from the live parameter"):
            fresh.load_state_dict(other)
    assert same(before, snapshot(fresh_model, fresh))
    train(fresh_model, fresh, range(1))
    assert all(float(fresh.state[p][STEP]) == 1.0 for p in fresh_model.parameters())
