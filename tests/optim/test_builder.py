"""build_optimizer: type selection, param groups by regex, no-decay rules, config errors."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_sft
from veoptim.config import to_config
from veoptim.config.schema import OptimConfig, ParamGroupConfig
from veoptim.errors import ConfigError
from veoptim.optim import (
    SUPPORTED_OPTIMIZERS,
    AdamW,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
    build_optimizer,
)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.attn = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)


def _groups(opt) -> dict[str, tuple[float, float]]:
    names = opt.param_names
    return {
        names[id(p)]: (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]
    }


@pytest.mark.parametrize(
    "name, cls, moments",
    [
        ("adamw", AdamW, "fp32"),
        ("full_fp32_adamw", FullFP32AdamW, "fp32"),
        ("master_fp32_adamw", MasterFP32AdamW, "bf16"),
        ("cpu_offload_adamw", CPUOffloadAdamW, "fp32"),
    ],
)
def test_each_supported_type_builds_its_class(name, cls, moments):
    cfg = OptimConfig(name=name, moment_dtype=moments, cpu_offload_param_patterns=["mlp"])
    assert type(build_optimizer(_Model(), cfg)) is cls


def test_unsupported_type_names_it_and_the_supported_ones():
    with pytest.raises(
        ValueError, match="'sgd'.*adamw, full_fp32_adamw, master_fp32_adamw, cpu_offload_adamw"
    ):
        build_optimizer(_Model(), OptimConfig(name="sgd"))
    assert SUPPORTED_OPTIMIZERS == (
        "adamw",
        "full_fp32_adamw",
        "master_fp32_adamw",
        "cpu_offload_adamw",
    )


def test_only_trainable_parameters_are_optimized():
    opt = build_optimizer(_Model(), OptimConfig(name="full_fp32_adamw"))
    assert not any(n.startswith("frozen") for n in _groups(opt))
    assert len(_groups(opt)) == 7


def test_norms_and_biases_get_no_weight_decay():
    opt = build_optimizer(_Model(), OptimConfig(name="adamw", weight_decay=0.1))
    groups = _groups(opt)
    assert groups["attn.bias"][1] == groups["input_layernorm.weight"][1] == 0.0
    assert groups["attn.weight"][1] == groups["embed.weight"][1] == 0.1


def test_param_groups_by_regex_first_match_wins():
    cfg = OptimConfig(
        name="full_fp32_adamw",
        lr=1e-3,
        weight_decay=0.1,
        param_groups=[
            ParamGroupConfig(pattern=r"^mlp\.", lr=5e-4),
            ParamGroupConfig(pattern=r"mlp|embed", lr=1e-5, weight_decay=0.0),
        ],
    )
    groups = _groups(build_optimizer(_Model(), cfg))
    assert groups["mlp.weight"] == (5e-4, 0.1)
    assert groups["mlp.bias"] == (5e-4, 0.0)  # no-decay rule still applies
    assert groups["embed.weight"] == (1e-5, 0.0)
    assert groups["attn.weight"] == (1e-3, 0.1)


def test_betas_eps_and_lr_reach_the_param_groups():
    cfg = OptimConfig(name="full_fp32_adamw", lr=2e-4, betas=[0.8, 0.95], eps=1e-6)
    group = build_optimizer(_Model(), cfg).param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"]) == (2e-4, (0.8, 0.95), 1e-6)


def test_param_group_pattern_matching_nothing_is_rejected():
    cfg = OptimConfig(name="adamw", param_groups=[ParamGroupConfig(pattern="lm_head", lr=1.0)])
    with pytest.raises(ConfigError, match="'lm_head' matches no trainable parameter"):
        build_optimizer(_Model(), cfg)


def test_invalid_regex_is_a_config_error():
    with pytest.raises(ConfigError, match="invalid regex"):
        build_optimizer(_Model(), OptimConfig(name="adamw", no_decay_patterns=["("]))


def test_moment_dtype_conflicting_with_the_type_is_rejected():
    with pytest.raises(ConfigError, match="master_fp32_adamw keeps bf16 moments"):
        build_optimizer(_Model(), OptimConfig(name="master_fp32_adamw", moment_dtype="fp32"))


def test_unknown_offload_moment_dtype_is_rejected():
    cfg = OptimConfig(
        name="cpu_offload_adamw", cpu_offload_param_patterns=["mlp"], cpu_moment_dtype="fp8"
    )
    with pytest.raises(ConfigError, match="optim.cpu_moment_dtype"):
        build_optimizer(_Model(), cfg)


@pytest.mark.parametrize("name", SUPPORTED_OPTIMIZERS)
def test_yaml_group_composes_and_builds_for_the_bundled_moe_model(name):
    from veoptim.models import build_model

    sft = to_config(compose_sft([f"optim={name}"]))
    assert sft.optim.name == name
    model_cfg = sft.model
    model_cfg.arch, model_cfg.num_experts = "qwen3_moe", 4
    opt = build_optimizer(build_model(model_cfg, 300), sft.optim)
    if name == "cpu_offload_adamw":
        assert any(g["cpu_offload"] for g in opt.param_groups)


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "wsd"])
def test_scheduler_yaml_group_composes(name):
    assert to_config(compose_sft([f"scheduler={name}"])).scheduler.name == name
