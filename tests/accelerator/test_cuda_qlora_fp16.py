"""QLoRA and fp16 on CUDA (skipped without a GPU; ``scripts/accelerator_check.sh`` runs them).

The 4-bit base is quantized on the host at load and dequantized on the device by
bitsandbytes' CUDA kernel: the device's NF4 layer must give the weight the host gives
(dequantization is a table lookup times the block scale: exact in BF16 and FP32), and a
QLoRA step must train the adapters only. An fp16 step on CUDA unscales in FP32 like on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.ckpt_state import build_trainer
from tests.lora.qlora_helpers import QLORA, nf4_layers
from tests.optim.helpers import HYPER, make_params, set_grads
from veoptim.config.schema import ModelConfig
from veoptim.models import build_model
from veoptim.optim import FullFP32AdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_nf4_layers_dequantize_on_cuda_to_the_hosts_weight():
    model = build_model(ModelConfig(dtype="bf16", quant="nf4"), 512)
    host = {n: m.dequantized() for n, m in nf4_layers(model).items()}
    model.to("cuda")
    for name, layer in nf4_layers(model).items():
        assert layer.nf4_codes.is_cuda
        assert torch.equal(layer.dequantized().cpu(), host[name]), name


def test_a_qlora_run_trains_adapters_on_cuda(tmp_path):
    trainer = build_trainer(tmp_path / "run", [*QLORA, "run.device=cuda"])
    trainer.resume()
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses)))
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)


def test_scaled_fp16_gradients_step_on_cuda_like_unscaled_ones():
    plain = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(torch.float16)]
    scaled = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(torch.float16)]
    a, b = FullFP32AdamW(plain, **HYPER), FullFP32AdamW(scaled, **HYPER)
    for step in range(4):
        set_grads(plain, step, torch.float16)
        for p, q in zip(plain, scaled, strict=True):
            q.grad = p.grad * 2.0**4
        a.step()
        b.step(grad_divisor=2.0**4)
    for p, q in zip(plain, scaled, strict=True):
        assert torch.equal(p, q)
