"""Build a causal LM: from a small config (tiny presets ship with the repo) or a local HF dir.

Everything is offline. The weight initialisation uses its own seed
(``model.init_seed``), so every rank of a distributed run and every fresh
process of a resumed run builds bitwise the same initial model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from veoptim.config.schema import ModelConfig
from veoptim.dtypes import resolve_dtype
from veoptim.errors import ConfigError

SUPPORTED_ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def _hf_config(cfg: ModelConfig, vocab_size: int, special: dict[str, int]) -> PretrainedConfig:
    if cfg.arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"model.arch must be one of {sorted(SUPPORTED_ARCHS)}, got {cfg.arch!r}.")
    config_cls, _ = SUPPORTED_ARCHS[cfg.arch]
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({cfg.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({cfg.num_attention_heads})."
        )
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        **special,
    )
    if cfg.arch != "qwen2":
        if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(
                f"model.arch={cfg.arch} needs model.num_experts >= 1 and 1 <= "
                f"model.num_experts_per_tok <= num_experts; got num_experts={cfg.num_experts}, "
                f"num_experts_per_tok={cfg.num_experts_per_tok}."
            )
        kwargs.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=True,
        )
        if cfg.arch == "qwen2_moe":
            kwargs.update(shared_expert_intermediate_size=cfg.moe_intermediate_size)
    return config_cls(**kwargs)


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    special_tokens: dict[str, int] | None = None,
    *,
    on_meta: bool = False,
) -> PreTrainedModel:
    """Build the model of ``cfg`` on CPU in ``cfg.dtype``, deterministically.

    ``special_tokens`` maps ``pad_token_id``/``bos_token_id``/``eos_token_id``
    to ids of the tokenizer, so exports carry a consistent config. ``on_meta``
    builds the same structure without storage or weights (no file is read): the
    ranks of a distributed run other than rank 0 do, and the parallel plan fills
    their shards from rank 0's weights, so host memory holds one full model per job.
    """
    dtype = resolve_dtype(cfg.dtype, "model.dtype")
    if cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.path must be a local HF model directory with config.json; got {path}."
            )
        if on_meta:
            with torch.device("meta"):
                config = AutoConfig.from_pretrained(path)
                return AutoModelForCausalLM.from_config(config, dtype=dtype).to(dtype)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf_config = _hf_config(cfg, vocab_size, special_tokens or {})
    _, model_cls = SUPPORTED_ARCHS[cfg.arch]
    if on_meta:
        with torch.device("meta"):
            return model_cls(hf_config).to(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = model_cls(hf_config)
    return model.to(dtype)
