"""The state components one by one, through their public calls: what each saves, what a
load of it refuses (before anything live changes) and that an accepted load restores it.

Single process, tiny objects: a ``Linear`` with veoptim's ``AdamW`` through a real
``Checkpointer`` for the tensor components, ``SavedComponent`` views for the JSON ones.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import SavedComponent, TensorSpec
from veoptim.distributed import LayoutMetadata
from veoptim.errors import CheckpointError
from veoptim.optim import AdamW
from veoptim.state import CONFIG, MODEL, JSONState, ModelState, OptimizerState, RNGState
from veoptim.state.optimizer import (
    PARAM_GROUPS,
    STATELESS,
    check_loadable,
    saved_param_groups,
    saved_stateless,
    to_json_param_groups,
)
from veoptim.state.run_config import RESUME_MUST_MATCH, WEIGHTS_ONLY_MUST_MATCH, RunConfigState
from veoptim.state.standard import weights_only
from veoptim.state.stateful import same_structure

CPU = torch.device("cpu")


def layout(ep: int = 1, experts: int = 0) -> LayoutMetadata:
    return LayoutMetadata(
        mesh_dim_names=("dp_shard",),
        mesh_dim_sizes=(1,),
        world_size=1,
        ep_size=ep,
        num_experts=experts,
        expert_placement=tuple((e,) for e in range(experts)) if ep > 1 else (),
    )


class TwoLayers(torch.nn.Module):
    """``second`` is trainable but unused by :func:`trained`'s loss: AdamW keeps no state
    for it (a stateless parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(3, 2)


def model_and_optimizer(seed: int, lr: float = 0.1) -> tuple[TwoLayers, AdamW]:
    torch.manual_seed(seed)
    model = TwoLayers()
    names = {id(p): n for n, p in model.named_parameters()}
    return model, AdamW(model.parameters(), lr=lr, param_names=names)


def trained(seed: int = 0) -> tuple[TwoLayers, AdamW]:
    model, optimizer = model_and_optimizer(seed)
    for _ in range(2):
        model.first(torch.randn(2, 4)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def components(model: torch.nn.Module, optimizer: AdamW, live: LayoutMetadata) -> dict:
    return {MODEL: ModelState(model), "optimizer": OptimizerState(model, optimizer, live)}


def saved_view(name: str, value: object, *, world_size: int = 1) -> SavedComponent:
    return SavedComponent(
        name=name, path=Path("/ckpt/v1"), json=value, tensors={}, step=3, world_size=world_size
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Checkpointer, TwoLayers, AdamW]:
    """A checkpointer with version ``a``: the trained model and optimizer (layout ep=1)."""
    model, optimizer = trained()
    checkpointer = Checkpointer(tmp_path, fsync=False)
    checkpointer.save(
        components(model, optimizer, layout()), "a", step=2, layout=layout().to_json()
    )
    return checkpointer, model, optimizer


# ---------------------------------------------------------------- model and optimizer
def test_model_and_optimizer_state_load_bitwise_with_a_stateless_parameter(checkpoint):
    checkpointer, model, optimizer = checkpoint
    fresh, fresh_opt = model_and_optimizer(seed=1, lr=0.5)
    assert not torch.equal(fresh.first.weight, model.first.weight)  # the load has work to do

    resolved, step = checkpointer.restore(components(fresh, fresh_opt, layout()), "a")

    assert step == 2 and resolved.name == "a"
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert fresh_opt.param_groups[0]["lr"] == 0.1  # the saved param groups
    saved = optimizer.state_dict()["state"]
    loaded = fresh_opt.state_dict()["state"]
    assert sorted(saved) == sorted(loaded) == [0, 1]  # first.weight, first.bias only
    for index in saved:
        for key, value in saved[index].items():
            assert torch.equal(value, loaded[index][key]), (index, key)
    recorded = json.loads((resolved.path / "state" / "optimizer.json").read_text())
    assert recorded[STATELESS] == ["second.weight", "second.bias"]


def test_optimizer_state_of_another_expert_layout_is_refused_before_anything_changes(
    checkpoint,
):
    checkpointer, _, _ = checkpoint
    fresh, fresh_opt = model_and_optimizer(seed=1)
    before = {n: p.clone() for n, p in fresh.named_parameters()}
    expert_parallel = layout(ep=2, experts=2)

    with pytest.raises(
        CheckpointError, match=r"number of experts differs \(saved 0, live 2\)"
    ) as info:
        checkpointer.restore(components(fresh, fresh_opt, expert_parallel), "a")

    assert "checkpoint.load_optimizer=false" in str(info.value)
    assert all(torch.equal(before[n], p) for n, p in fresh.named_parameters())
    assert not fresh_opt.state  # nothing installed
    # negative control: the same load under the saved layout goes through
    checkpointer.restore(components(fresh, fresh_opt, layout()), "a")
    assert fresh_opt.state


def test_a_model_of_another_shape_is_refused_naming_the_tensor(checkpoint):
    checkpointer, _, _ = checkpoint
    other = torch.nn.Module()
    other.first = torch.nn.Linear(4, 5)
    other.second = torch.nn.Linear(3, 2)
    before = other.first.weight.clone()
    with pytest.raises(CheckpointError, match=r"first\.weight \(expected \[5, 4\]"):
        checkpointer.restore({MODEL: ModelState(other)}, "a", exact=False)
    assert torch.equal(other.first.weight, before)


def test_optimizer_state_that_a_load_would_reject_is_never_saved():
    spec = TensorSpec((3, 4), torch.float32)
    expected = {"w.exp_avg": spec, "w.exp_avg_sq": spec}
    good = {"w": {"exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4)}}
    check_loadable(good, expected)  # negative control: a complete state passes
    with pytest.raises(CheckpointError, match=r"could not be restored\): w\.exp_avg_sq"):
        check_loadable({"w": {"exp_avg": torch.zeros(3, 4)}}, expected)
    wrong_dtype = {"w": {"exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4).bfloat16()}}
    with pytest.raises(
        CheckpointError, match=r"w\.exp_avg_sq \(\[3, 4\] bfloat16 vs \[3, 4\] float32\)"
    ):
        check_loadable(wrong_dtype, expected)


def test_param_groups_become_json_and_come_back_with_tuple_betas():
    groups = [{"lr": torch.tensor(0.25), "betas": (0.9, 0.95), "params": ["w"]}]
    as_json = to_json_param_groups(groups)
    assert as_json == [{"lr": 0.25, "betas": [0.9, 0.95], "params": ["w"]}]
    view = saved_view("optimizer", json.loads(json.dumps({PARAM_GROUPS: as_json})))
    assert saved_param_groups(view, live_groups=1)[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(
    "saved, found",
    [
        ({PARAM_GROUPS: [{}, {}]}, "found 2"),
        ({PARAM_GROUPS: None}, "found None"),
        ([], "found None"),
    ],
)
def test_param_groups_of_another_count_are_refused(saved, found):
    with pytest.raises(CheckpointError, match="expected 1 groups, " + found) as info:
        saved_param_groups(saved_view("optimizer", saved), live_groups=1)
    assert "optimizer param groups of optimizer in /ckpt/v1" in str(info.value)


@pytest.mark.parametrize("names", [["nope.weight"], "second.weight", [3]])
def test_stateless_names_must_be_parameters_the_optimizer_holds(names):
    model, optimizer = model_and_optimizer(seed=0)
    view = saved_view("optimizer", {STATELESS: ["second.bias"]})
    assert saved_stateless(view, model, optimizer) == {"second.bias"}  # negative control
    with pytest.raises(CheckpointError, match="must name parameters this optimizer holds"):
        saved_stateless(saved_view("optimizer", {STATELESS: names}), model, optimizer)


# ---------------------------------------------------------------- JSON state objects
class Counter:
    """A ``state_dict`` object whose load mutates before it validates (as careless ones do)."""

    def __init__(self) -> None:
        self.count, self.label = 0, "start"

    def state_dict(self) -> dict:
        return {"count": self.count, "label": self.label}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]
        self.label = state["label"]


def test_json_state_round_trip_installs_only_on_install():
    source, target = Counter(), Counter()
    source.count, source.label = 7, "seven"
    saved = JSONState(source).state()
    assert saved.json == {"count": 7, "label": "seven"} and not saved.tensors

    staged = JSONState(target).stage(saved_view("progress", json.loads(json.dumps(saved.json))))
    assert (target.count, target.label) == (0, "start")  # staging changes nothing
    staged.install()
    assert (target.count, target.label) == (7, "seven")


def test_json_state_that_fails_to_load_leaves_the_live_object_as_it_was():
    live = Counter()
    with pytest.raises(CheckpointError) as info:
        JSONState(live).stage(saved_view("progress", {"count": 3}))
    assert str(info.value) == ("progress state in /ckpt/v1 cannot be loaded: KeyError: 'label'.")
    assert (live.count, live.label) == (0, "start")  # the trial load ran on a copy


def scheduler() -> torch.optim.lr_scheduler.LRScheduler:
    _, optimizer = model_and_optimizer(seed=0)
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)


def test_scheduler_state_of_the_same_structure_loads():
    live = scheduler()
    saved = json.loads(json.dumps(scheduler().state_dict()))
    saved["last_epoch"] = 3
    JSONState(live, check=same_structure).stage(saved_view("lr_scheduler", saved)).install()
    assert live.last_epoch == 3


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda s: s.pop("last_epoch"), "state: keys \\["),
        (lambda s: s.update(base_lrs=[0.1, 0.1]), "state.base_lrs: expected a list of 1, found 2"),
        (lambda s: s.update(last_epoch="3"), "state.last_epoch: '3' where a int is expected"),
        (lambda s: s.update(last_epoch=True), "state.last_epoch: True where a int is expected"),
        (lambda s: s.update(base_lrs=0.1), "state.base_lrs: expected a list of 1, found float"),
    ],
    ids=["missing key", "list length", "string for int", "bool for int", "scalar for list"],
)
def test_scheduler_state_of_another_structure_is_refused_naming_where(edit, problem):
    live = scheduler()
    before = live.state_dict()
    saved = json.loads(json.dumps(live.state_dict()))
    edit(saved)
    with pytest.raises(CheckpointError, match="lr_scheduler state in /ckpt/v1 does not fit "
                       "the live object: " + problem):  # fmt: skip
        JSONState(live, check=same_structure).stage(saved_view("lr_scheduler", saved))
    assert live.state_dict() == before


def test_a_whole_number_where_a_float_was_saved_fits():
    """JSON writes 1.0 as 1.0 but a hand-edited or older file may hold 1: both are numbers."""
    live = scheduler()
    saved = json.loads(json.dumps(live.state_dict()))
    saved["start_factor"] = 1
    same_structure(live, saved, "lr_scheduler")


# ---------------------------------------------------------------- RNG
def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = RNGState(CPU, world_size=1).state()
    assert state.json_per_rank and not state.tensors
    expected = draws()
    saved = saved_view("rng", json.loads(json.dumps(state.json)))
    staged = RNGState(CPU, world_size=1).stage(saved)
    assert draws() != expected  # staging restores nothing yet
    staged.install()
    assert draws() == expected


def test_rng_states_of_another_world_size_are_left_alone_with_a_warning(caplog):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = saved_view("rng", RNGState(CPU, world_size=2).state().json, world_size=2)
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="veoptim.state.rng"):
        staged = RNGState(CPU, world_size=1).stage(saved)
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    staged.install()
    undisturbed = draws()
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    assert draws() == undisturbed
    assert "RNG states are not restored: /ckpt/v1 was saved on 2 ranks, this run has 1" in (
        caplog.text
    )


@pytest.mark.parametrize(
    "value, found",
    [({"python": [], "numpy": {}}, "['numpy', 'python']"), ([1, 2], "list"), (None, "NoneType")],
)
def test_malformed_rng_state_is_refused_naming_its_keys(value, found):
    with pytest.raises(CheckpointError) as info:
        RNGState(CPU, world_size=1).stage(saved_view("rng", value))
    assert str(info.value) == (
        "RNG state in rng state in /ckpt/v1 must have keys "
        f"['python', 'numpy', 'torch_cpu', 'device'], found {found}."
    )


# ---------------------------------------------------------------- run config
CONFIG_VALUE = {
    "model": {"arch": "qwen3", "path": "", "hidden_size": 64},
    "train": {"seed": 0, "max_steps": 10},
    "optim": {"name": "adamw", "lr": 1e-3},
    "logging": {"progress": True},
}


def with_change(section: str, key: str, value: object) -> dict:
    config = json.loads(json.dumps(CONFIG_VALUE))
    config[section][key] = value
    return config


def test_run_config_is_saved_as_is_and_never_installed():
    live = json.loads(json.dumps(CONFIG_VALUE))
    component = RunConfigState(live, defaults=CONFIG_VALUE)
    assert component.state().json == CONFIG_VALUE
    staged = component.stage(saved_view(CONFIG, with_change("logging", "progress", False)))
    staged.install()
    assert live == CONFIG_VALUE and staged.buffers == {} and staged.expected == {}


def test_a_full_resume_refuses_another_result_and_says_how_to_load_weights_only():
    component = RunConfigState(CONFIG_VALUE, RESUME_MUST_MATCH)
    with pytest.raises(CheckpointError) as info:
        component.stage(saved_view(CONFIG, with_change("train", "seed", 5)))
    assert str(info.value) == (
        "checkpoint /ckpt/v1 was written by a run with a different config: train.seed: saved 5, "
        "live 0 (checkpoint.load_optimizer=false resumes weights only)."
    )


def test_a_weights_only_load_compares_the_model_keys_only():
    model, optimizer = model_and_optimizer(seed=0)
    full = {MODEL: ModelState(model), "optimizer": OptimizerState(model, optimizer, layout())}
    subset = weights_only(full, CONFIG_VALUE)
    assert list(subset) == [MODEL, CONFIG] and subset[MODEL] is full[MODEL]
    config = subset[CONFIG]
    assert config.must_match == WEIGHTS_ONLY_MUST_MATCH
    config.stage(saved_view(CONFIG, with_change("train", "seed", 5)))  # not compared
    with pytest.raises(CheckpointError) as info:
        config.stage(saved_view(CONFIG, with_change("model", "arch", "llama")))
    message = str(info.value)
    assert "model.arch: saved 'llama', live 'qwen3'" in message
    assert "load_optimizer" not in message  # no hint: this already is the weights-only load


@pytest.mark.parametrize("value", [None, [1], "config"])
def test_a_run_config_that_is_not_a_mapping_is_refused(value):
    with pytest.raises(CheckpointError, match=r"^the config state in /ckpt/v1 is not a mapping\.$"):
        RunConfigState(CONFIG_VALUE).stage(saved_view(CONFIG, value))
