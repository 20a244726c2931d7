"""A LoRA model trained on 2 gloo ranks (dense FSDP2, and MoE with expert parallelism)
exports a PEFT adapter that ``PeftModel`` loads with no key warning and that reproduces
the sharded model's own logits (FP32 compute)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.checkpoint.ckpt_state import build_trainer
from tests.distributed.spawn import run_ranks
from tests.lora.helpers import INPUT_IDS, load_peft_strictly, logits
from veoptim.lora import DEFAULT_ADAPTER, lora_experts, lora_layers
from veoptim.lora.peft_format import (
    adapter_config,
    base_state,
    peft_adapter_state,
    write_peft_adapter,
)

pytestmark = pytest.mark.slow

CASES = {
    "dense_fsdp": ["parallel=fsdp"],
    "moe_ep2": ["model=tiny_moe", "parallel=fsdp_ep2"],
    "moe_ep2_experts": [
        "model=tiny_moe",
        "parallel=fsdp_ep2",
        "lora.target_experts=[gate_up_proj,down_proj]",
    ],
}
COMMON = ["lora.enabled=true", "lora.r=4", "parallel.param_dtype=fp32", "optim=full_fp32_adamw"]


def _train_and_export(ctx, out: Path) -> dict:
    for case, overrides in CASES.items():
        trainer = build_trainer(out / case, [*COMMON, *overrides], ctx)
        for _ in range(3):
            trainer.train_step()
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(input_ids=INPUT_IDS, use_cache=False).logits.float()
            experts = [e.adapters for e in lora_experts(trainer.model).values()]
            layers = [*lora_layers(trainer.model).values(), *experts]
            for layer in layers:  # the sharded base alone: its own numerics, measured
                layer.active = ()
            base_only = trainer.model(input_ids=INPUT_IDS, use_cache=False).logits.float()
            for layer in layers:
                layer.active = (DEFAULT_ADAPTER,)
        adapter, base = peft_adapter_state(trainer.model), base_state(trainer.model)  # collective
        if ctx.is_main:
            (out / case).mkdir(parents=True, exist_ok=True)
            torch.save(ours, out / case / "logits.pt")
            torch.save(base_only, out / case / "base_logits.pt")
            config = trainer.model.config
            model = AutoModelForCausalLM.from_config(config)
            model.load_state_dict(base)
            model.save_pretrained(out / case / "base")
            (out / case / "adapter").mkdir()
            cfg = adapter_config(trainer.cfg.lora, trainer.model, str(out / case / "base"))
            write_peft_adapter(out / case / "adapter", adapter, cfg)
    return {}


@functools.cache
def _exported(root: str) -> Path:
    run_ranks(2, _train_and_export, Path(root))
    return Path(root)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return _exported(str(tmp_path_factory.mktemp("lora2")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_reproduces_the_two_rank_lora_model(exported, case):
    base = AutoModelForCausalLM.from_pretrained(exported / case / "base").eval()
    peft_model = load_peft_strictly(base, exported / case / "adapter")
    sharded = torch.load(exported / case / "logits.pt", weights_only=True)
    # Expert parallelism sums the experts' outputs in another order than transformers: that
    # difference of the base alone is allowed on top of the 1e-5 (it is 0 for dense FSDP).
    sharded_base = torch.load(exported / case / "base_logits.pt", weights_only=True)
    base_numerics = (logits(base) - sharded_base).abs().max().item()
    assert base_numerics <= (1e-3 if "ep" in case else 1e-5)
    assert (logits(peft_model) - sharded).abs().max() <= 1e-5 + 2 * base_numerics
    assert (logits(base) - sharded).abs().max() > 1e-4  # three steps moved the adapters
    config = json.loads((exported / case / "adapter" / "adapter_config.json").read_text())
    assert "q_proj" in config["target_modules"]
    if case.endswith("experts"):
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
