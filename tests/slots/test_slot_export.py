"""A slot's export is a PEFT adapter directory: PeftModel loads it onto the exported base
with no missing or unexpected keys and reproduces that slot's outputs."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from tests.lora.helpers import INPUT_IDS, load_peft_strictly
from tests.lora.helpers import logits as peft_logits
from tests.slots.helpers import build, train


def slot_logits(trainer, slot: int) -> torch.Tensor:
    ids = torch.full((INPUT_IDS.shape[0],), slot)
    trainer.router.route(ids, [slot])
    try:
        with torch.no_grad():
            return trainer.model(input_ids=INPUT_IDS, use_cache=False).logits.float()
    finally:
        trainer.router.clear()


def test_exported_slots_load_in_peft_and_reproduce_their_outputs(tmp_path):
    trainer = build(tmp_path, **{"model.dtype": "fp32", "export.dtype": "preserve"})
    trainer.create_slot(0)
    trainer.create_slot(1, r=4, alpha=8.0, use_rslora=True)
    train(trainer, 3, [0, 1])
    exports = {slot: trainer.export_slot(slot, f"tenant{slot}") for slot in (0, 1)}
    base_dir = tmp_path / "exports" / "hf_base"
    for slot, out in exports.items():
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base_dir.absolute())
        assert (config["r"], config["lora_alpha"]) == ((8, 16.0) if slot == 0 else (4, 8.0))
        assert config["use_rslora"] is (slot == 1)
        assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
        base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
        model = load_peft_strictly(base, out)
        torch.testing.assert_close(peft_logits(model), slot_logits(trainer, slot))
    # The adapters differ, so each export reproduces its own slot only.
    assert not torch.allclose(slot_logits(trainer, 0), slot_logits(trainer, 1))


def test_a_reused_run_dir_republishes_a_base_of_another_seed(tmp_path):
    """exports/hf_base of an earlier run with another base is replaced, not reused."""
    overrides = {"model.dtype": "fp32", "export.dtype": "preserve"}
    first = build(tmp_path, **overrides)
    first.create_slot(0)
    first.export_slot(0, "first")
    second = build(tmp_path, **{**overrides, "model.init_seed": 7})
    second.create_slot(0)
    train(second, 2, [0])
    out = second.export_slot(0, "second")
    config = json.loads((out / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    model = load_peft_strictly(base, out)
    torch.testing.assert_close(peft_logits(model), slot_logits(second, 0))
