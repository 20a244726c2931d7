"""Exports of a QLoRA run: the PEFT adapter loads with plain ``peft`` on the full-precision
base it was quantized from; the merged export is the dequantized base plus the adapters,
in the saved dtype; how close each is to the 4-bit training-time forward is measured (the
figures are the docs' ``docs/lora.md``)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from callbacks import standard_callbacks
from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import build_trainer
from tests.lora.helpers import INPUT_IDS, load_peft_strictly, logits
from tests.lora.qlora_helpers import from_path, nf4_layers, save_hf_base
from veoptim.export.lora_formats import lora_model
from veoptim.export.source import open_checkpoint
from veoptim.lora import lora_layers

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A QLoRA run on an HF checkpoint, its PEFT adapter, and a merged export in BF16."""
    root = tmp_path_factory.mktemp("qlora_exports")
    base = save_hf_base(root / "hf_base")
    run_dir = root / "run"
    trainer = build_trainer(run_dir, [*from_path(base), f"train.max_steps={STEPS}",
                                      "export.hf=true", "optim.lr=3e-2"])  # fmt: skip
    trainer.callbacks.callbacks = standard_callbacks(trainer.cfg, {})
    trainer.train()
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    argv = [str(checkpoint), "--out", str(root / "exports"), "--name", "merged", "--format",
            "merged", "--dtype", "bf16", "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    quantized = lora_model(open_checkpoint(checkpoint))  # the training-time forward: 4-bit base
    return {"base": base, "adapter": run_dir / "exports" / "lora_final",
            "merged": root / "exports" / "merged", "quantized": quantized}  # fmt: skip


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The RMS of ``a - b`` over the RMS of ``b``."""
    return float((a - b).norm() / b.norm())


def test_the_peft_adapter_loads_with_plain_peft_on_the_full_precision_base(qlora_run):
    config = json.loads((qlora_run["adapter"] / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(qlora_run["base"].absolute())
    base = AutoModelForCausalLM.from_pretrained(qlora_run["base"], dtype=torch.bfloat16)
    model = load_peft_strictly(base, qlora_run["adapter"])  # no missing or unexpected key
    full = logits(model)
    quantized = logits(qlora_run["quantized"])
    plain = logits(base.eval())
    assert not torch.equal(full, plain)  # the adapters trained: they change the output
    # the quantized training forward and the full-precision base differ by NF4's error only
    assert _relative(full, quantized) < 0.6  # ~0.39 measured on this random-init base


def test_the_merged_export_is_the_dequantized_base_plus_the_adapters_in_bf16(qlora_run):
    merged = AutoModelForCausalLM.from_pretrained(qlora_run["merged"], dtype=torch.bfloat16)
    quantized = qlora_run["quantized"]
    state = merged.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    adapted = lora_layers(quantized)
    for name, layer in nf4_layers(quantized).items():
        fqn = name.replace(".base_layer", "")
        expected = layer.dequantized().float()
        if fqn in adapted:
            a, b = adapted[fqn].lora_A["default"].weight, adapted[fqn].lora_B["default"].weight
            expected = expected + (b.float() @ a.float()) * adapted[fqn].specs["default"].scaling
        assert torch.equal(state[f"{fqn}.weight"], expected.to(torch.bfloat16)), fqn
    # the merged BF16 model against the training forward (dequantize, then the adapter path)
    assert _relative(logits(merged.eval()), logits(quantized)) < 0.03  # ~0.015 measured


def test_closeness_figures(qlora_run, capsys):
    """The numbers docs/lora.md quotes (printed with ``-s``)."""
    quantized = logits(qlora_run["quantized"])
    base = AutoModelForCausalLM.from_pretrained(qlora_run["base"], dtype=torch.bfloat16)
    peft_full = logits(load_peft_strictly(base, qlora_run["adapter"]))
    merged = logits(AutoModelForCausalLM.from_pretrained(qlora_run["merged"],
                                                         dtype=torch.bfloat16).eval())  # fmt: skip
    same_argmax = lambda x: float((x.argmax(-1) == quantized.argmax(-1)).float().mean())  # noqa: E731
    figures = {
        "merged_bf16_vs_training_forward": {"rel_rms": _relative(merged, quantized),
                                            "argmax_agree": same_argmax(merged)},
        "peft_on_full_base_vs_training_forward": {"rel_rms": _relative(peft_full, quantized),
                                                  "argmax_agree": same_argmax(peft_full)},
        "tokens": int(INPUT_IDS.numel()),
    }  # fmt: skip
    with capsys.disabled():
        print("\nQLoRA closeness:", json.dumps(figures))
    assert figures["merged_bf16_vs_training_forward"]["argmax_agree"] >= 0.9
