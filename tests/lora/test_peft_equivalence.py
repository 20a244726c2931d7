"""Our LoRA layer is PEFT's LoRA: same outputs for the same adapter tensors, same dropout
position and scaling, same init; the PEFT export loads with no missing or unexpected key,
and the merged export equals the adapter applied to its base."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from tests.lora.helpers import load_peft_strictly, logits
from veoptim.config.schema import LoRAConfig, ModelConfig
from veoptim.data import load_tokenizer
from veoptim.lora import DEFAULT_ADAPTER, LoRALinear, apply_lora, lora_experts, lora_layers
from veoptim.lora.peft_format import (
    ADAPTER_CONFIG_FILE,
    adapter_config,
    base_state,
    merged_state,
    peft_adapter_state,
    write_peft_adapter,
)
from veoptim.models import build_model

MODELS = {
    "dense": ModelConfig(),
    "moe": ModelConfig(name="tiny_moe", arch="qwen3_moe", num_experts=4, num_experts_per_tok=2),
}


def _base(kind: str):
    tokenizer = load_tokenizer("")
    return build_model(MODELS[kind], len(tokenizer), {})


def _adapted(base, cfg: LoRAConfig):
    model = copy.deepcopy(base)
    apply_lora(model, cfg, seed=3)
    with torch.no_grad():  # a trained-looking B (a fresh one is zero)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model.eval()


EXPERTS = ["gate_up_proj", "down_proj"]
CASES = {
    "dense": ("dense", []),
    "moe": ("moe", []),
    "moe_experts": ("moe", EXPERTS),  # per-expert adapters, PEFT's target_parameters
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_the_peft_export_reproduces_our_logits(tmp_path, case, rslora):
    kind, experts = CASES[case]
    base = _base(kind)
    cfg = LoRAConfig(enabled=True, r=4, alpha=12.0, use_rslora=rslora, target_experts=experts)
    ours = _adapted(base, cfg)
    base.save_pretrained(tmp_path / "base")
    (tmp_path / "adapter").mkdir()
    config = adapter_config(cfg, ours, str(tmp_path / "base"))
    write_peft_adapter(tmp_path / "adapter", peft_adapter_state(ours), config)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 12.0 and config["use_rslora"] is rslora
    peft_model = load_peft_strictly(base, tmp_path / "adapter")
    assert (logits(ours) - logits(base)).abs().max() > 1e-3  # the adapters do something
    assert (logits(peft_model) - logits(ours)).abs().max() <= 1e-5
    merged = copy.deepcopy(base)
    merged.load_state_dict(merged_state(ours))
    assert (logits(merged.eval()) - logits(ours)).abs().max() <= 1e-5


def test_scaling_init_and_dropout_position_are_peft_s(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = _base("dense")
    cfg = LoRAConfig(enabled=True, r=4, alpha=8.0, dropout=0.3, target_modules=["q_proj"])
    ours = copy.deepcopy(base)
    apply_lora(ours, cfg, seed=11)
    theirs = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.3,
                                                            target_modules=["q_proj"]))  # fmt: skip
    layer = next(iter(lora_layers(ours).values()))
    assert layer.specs[DEFAULT_ADAPTER].scaling == 2.0
    # Init: B zero (the model is unchanged), A Kaiming-uniform with a = sqrt(5).
    assert torch.count_nonzero(layer.lora_B[DEFAULT_ADAPTER].weight) == 0
    bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform(a=sqrt(5)) bound
    a = layer.lora_A[DEFAULT_ADAPTER].weight
    assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound
    # Same adapter tensors in both, then train mode: dropout draws the same mask only if it
    # sits at the same place (on the adapter input) and runs in the same order.
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
        their_params = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            if ".lora_" in name:
                their_params[f"base_model.model.{name}"].copy_(param)
    ours.train()
    theirs.train()
    torch.manual_seed(0)
    out_ours = ours(input_ids=torch.arange(12)[None], use_cache=False).logits
    torch.manual_seed(0)
    out_theirs = theirs(input_ids=torch.arange(12)[None], use_cache=False).logits
    assert torch.equal(out_ours, out_theirs)


def test_targets_and_frozen_base():
    base = _base("dense")
    model = copy.deepcopy(base)
    names = apply_lora(
        model, LoRAConfig(enabled=True, target_regex=r".*\.layers\.1\..*_proj"), seed=0
    )
    assert names and all(".layers.1." in n for n in names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    assert base_state(model).keys() == base.state_dict().keys()


def test_a_target_that_selects_nothing_is_a_config_error():
    from veoptim.errors import ConfigError

    with pytest.raises(ConfigError, match=r"selects no Linear layer.*q_proj"):
        apply_lora(_base("dense"), LoRAConfig(enabled=True, target_modules=["qkv"]), seed=0)


def test_a_missing_adapter_key_is_caught_by_the_strict_load(tmp_path):
    """Negative control: PEFT only warns about a missing key; the strict load fails on it."""
    base = _base("dense")
    cfg = LoRAConfig(enabled=True, r=4, alpha=8.0)
    ours = _adapted(base, cfg)
    state = peft_adapter_state(ours)
    state.pop(next(k for k in state if "lora_B" in k))
    (tmp_path / "adapter").mkdir()
    write_peft_adapter(tmp_path / "adapter", state, adapter_config(cfg, ours, "unused"))
    with pytest.raises(AssertionError, match="missing"):
        load_peft_strictly(base, tmp_path / "adapter")


def test_expert_adapters_need_a_moe_model_and_no_dropout():
    from veoptim.errors import ConfigError

    with pytest.raises(ConfigError, match="no fused MoE experts"):
        apply_lora(_base("dense"), LoRAConfig(enabled=True, target_experts=EXPERTS), seed=0)
    with pytest.raises(ConfigError, match="needs lora.dropout=0"):
        apply_lora(
            _base("moe"), LoRAConfig(enabled=True, dropout=0.1, target_experts=EXPERTS), seed=0
        )
    with pytest.raises(ConfigError, match="may name"):
        apply_lora(_base("moe"), LoRAConfig(enabled=True, target_experts=["w1"]), seed=0)


def test_expert_adapters_are_per_expert_and_start_at_zero():
    model = _base("moe")
    apply_lora(
        model, LoRAConfig(enabled=True, r=4, target_modules=[], target_experts=EXPERTS), seed=0
    )
    (name, experts), *_ = lora_experts(model).items()
    gate_up = experts.base_layer.gate_up_proj
    a = experts.adapters.lora_A[DEFAULT_ADAPTER]["gate_up_proj"]
    b = experts.adapters.lora_B[DEFAULT_ADAPTER]["gate_up_proj"]
    assert a.shape == (gate_up.shape[0], 4, gate_up.shape[2]) and b.shape == (*gate_up.shape[:2], 4)
    assert torch.count_nonzero(b) == 0 and a.abs().max() <= 1 / math.sqrt(gate_up.shape[2])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".experts.base_layer.lora.lora_" in n for n in trainable)
