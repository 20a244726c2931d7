"""QLoRA (``model.quant=nf4``) through the real Trainer, on real bitsandbytes NF4 codes.

The decoder's Linear weights of an HF checkpoint are quantized as they are read (bitwise
what bitsandbytes gives for the loaded weight); only the adapters train, in full
precision with FP32 masters; the 4-bit base never changes; checkpoints hold adapters
only and resume bitwise; the same base in another quantization is refused; MoE experts
and a run without LoRA are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.checkpoint.helpers.ckpt_io import read_checkpoint
from tests.lora.qlora_helpers import QLORA, from_path, nf4_layers, save_hf_base
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.config.schema import ModelConfig
from veoptim.errors import CheckpointError, ConfigError
from veoptim.models import build_model, quant
from veoptim.models.quant import BLOCK_SIZE, quantize_model
from veoptim.models.sharded_load import SafetensorsShards
from veoptim.optim import MASTER_WEIGHT

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return save_hf_base(tmp_path_factory.mktemp("hf_base"))


def test_the_decoder_linears_hold_bitsandbytes_nf4_codes_and_the_lm_head_stays(hf_base):
    import bitsandbytes.functional as bnb

    model = build_model(ModelConfig(path=str(hf_base), dtype="bf16", quant="nf4"), 0)
    layers = nf4_layers(model)
    assert sorted({n.rsplit(".", 1)[-1] for n in layers}) == sorted(DECODER_LINEARS)
    assert len(layers) == 7 * model.config.num_hidden_layers
    assert isinstance(model.lm_head, torch.nn.Linear)
    stored = load_file(hf_base / "model.safetensors")
    for name, layer in layers.items():
        weight = stored[f"{name}.weight"]
        codes, state = bnb.quantize_4bit(weight, blocksize=BLOCK_SIZE, quant_type="nf4")
        assert torch.equal(layer.nf4_codes, codes.view(-1))  # bitsandbytes' own NF4 codes
        assert torch.equal(layer.nf4_absmax, state.absmax)
        assert layer.nf4_codes.numel() * 2 == weight.numel()  # 4 bits a weight (+ a scale/64)
        error = (layer.dequantized().float() - weight.float()).abs().mean()
        assert 0 < error < 0.12 * weight.float().abs().mean()  # NF4's error, not garbage
    assert not any(k.endswith(DECODER_LINEARS) for k in model.state_dict())


@pytest.mark.parametrize("chunk", [quant.QUANTIZE_CHUNK, 2 * BLOCK_SIZE])
def test_quantizing_while_reading_equals_quantizing_the_loaded_model(hf_base, monkeypatch, chunk):
    """Read and quantized a few rows at a time (the small chunk: two blocks of weights, so
    every layer takes many reads), the codes are those of the whole loaded weight."""
    monkeypatch.setattr(quant, "QUANTIZE_CHUNK", chunk)
    reads = []
    read_rows = SafetensorsShards.read_rows
    monkeypatch.setattr(
        SafetensorsShards, "read_rows", lambda self, *a: reads.append(a) or read_rows(self, *a)
    )
    streamed = build_model(ModelConfig(path=str(hf_base), dtype="bf16", quant="nf4"), 0)
    assert len(reads) > (len(nf4_layers(streamed)) if chunk == 2 * BLOCK_SIZE else 0)
    assert all(stop - start <= max(1, chunk // 64) for _, start, stop in reads)
    loaded = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.bfloat16)
    quantize_model(loaded, torch.bfloat16)
    assert_bitwise_equal(dict(streamed.state_dict()), dict(loaded.state_dict()))
    assert_bitwise_equal(dict(streamed.named_buffers()), dict(loaded.named_buffers()))


def test_only_the_adapters_train_in_full_precision_and_the_4bit_base_never_changes(
    tmp_path, hf_base
):
    trainer = build_trainer(tmp_path / "run", from_path(hf_base))
    before = {n: m.nf4_codes.clone() for n, m in nf4_layers(trainer.model).items()}
    trainer.resume()
    for _ in range(3):
        trainer.train_step()
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    states = list(trainer.optimizer.state.values())
    assert len(states) == len(trained)
    assert all(s[MASTER_WEIGHT].dtype == torch.float32 for s in states)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in states)  # master_fp32_adamw
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if ".lora_B." in n)
    after = {n: m.nf4_codes for n, m in nf4_layers(trainer.model).items()}
    assert_bitwise_equal(before, after)


def test_a_qlora_checkpoint_holds_adapters_only_and_resumes_bitwise(tmp_path, hf_base):
    overrides = from_path(hf_base)
    straight = build_trainer(tmp_path / "straight", overrides)
    for _ in range(4):
        straight.train_step()
    first = build_trainer(tmp_path / "first", overrides)
    first.train_step()
    first.train_step()
    ckpt = Checkpointer(tmp_path / "ckpt", fsync=False)
    save_with(ckpt, first, "s2")
    saved = read_checkpoint(tmp_path / "ckpt" / "s2")
    model_keys = [k for k in saved.tensors if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert saved.trainer_state["model"]["base"]["quant"] == "nf4"
    resumed = build_trainer(tmp_path / "resumed", overrides)
    load_with(ckpt, resumed, "s2")
    resumed.train_step()
    resumed.train_step()
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))


@pytest.mark.parametrize("saved_quant, live_quant", [("nf4", "none"), ("none", "nf4")])
def test_the_same_base_in_another_quantization_is_refused(
    tmp_path, hf_base, saved_quant, live_quant
):
    first = build_trainer(tmp_path / "a", [*from_path(hf_base), f"model.quant={saved_quant}"])
    first.train_step()
    ckpt = Checkpointer(tmp_path / "ckpt", fsync=False)
    save_with(ckpt, first, "s1")
    other = build_trainer(tmp_path / "b", [*from_path(hf_base), f"model.quant={live_quant}"])
    before = snapshot(other)
    with pytest.raises(CheckpointError) as error:
        load_with(ckpt, other, "s1", load_optimizer=False)  # weights only: the base check alone
    message = str(error.value)
    assert "were trained on another base model (quant differs)" in message
    assert f"stored {saved_quant}), found" in message and f"stored {live_quant});" in message
    assert "lora.allow_other_base=true" in message
    assert_bitwise_equal(before, snapshot(other))


def test_moe_experts_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        build_trainer(tmp_path / "run", [*QLORA, "model=tiny_moe"])
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("model.quant=nf4 quantizes Linear layers, but this model's")


def test_a_4bit_base_without_lora_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match="model.quant=nf4 freezes the base in 4 bits, which only a LoRA run"
    ):
        build_trainer(tmp_path / "run", ["model.quant=nf4"])
