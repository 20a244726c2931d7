"""A small Hugging Face checkpoint to quantize (the bundled tiny model in BF16, saved as
safetensors with the bundled tokenizer), and the QLoRA overrides over it."""

from __future__ import annotations

from pathlib import Path

import torch

from veoptim.config.schema import ModelConfig
from veoptim.data import load_tokenizer, special_token_ids
from veoptim.models import build_model

QLORA = ["lora.enabled=true", "lora.r=4", "optim=master_fp32_adamw", "model.dtype=bf16",
         "model.quant=nf4", "optim.lr=1e-2"]  # fmt: skip


def save_hf_base(out: Path, seed: int = 7) -> Path:
    """A BF16 tiny dense model (random, ``seed``) as an HF directory with its tokenizer."""
    tokenizer = load_tokenizer()
    model = build_model(
        ModelConfig(dtype="bf16", init_seed=seed), len(tokenizer), special_token_ids(tokenizer)
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def from_path(base: Path) -> list[str]:
    """The QLoRA overrides on the HF checkpoint ``base``."""
    return [*QLORA, "model=hf_local", f"model.path={base}"]


def nf4_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from veoptim.models.quant import NF4Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}
