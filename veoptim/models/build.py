"""Build a causal LM: from a small config (tiny presets ship with the repo) or a local HF dir.

Everything is offline. The weight initialisation uses its own seed
(``model.init_seed``), so every rank of a distributed run and every fresh
process of a resumed run builds bitwise the same initial model.
"""

from __future__ import annotations

import logging
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
from veoptim.models.activation_checkpointing import enable_activation_checkpointing
from veoptim.models.attention import VARLEN, check_attn_implementation
from veoptim.models.compile import compile_layers
from veoptim.models.quant import NF4, load_quantized, quantize_model
from veoptim.models.sharded_load import SafetensorsShards, parameters_on_meta

log = logging.getLogger(__name__)

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
        attention_dropout=cfg.attention_dropout,
        attn_implementation=cfg.attn_implementation,
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


def _local_config(path: Path) -> PretrainedConfig:
    """The HF config of the model directory ``model.path`` (config.json only, no weights)."""
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path must be a local HF model directory with config.json; got {path}."
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(
            f"model.path {path}: config.json could not be read by transformers "
            f"(expected a causal LM config): {str(error).splitlines()[0]}"
        ) from error
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model_fits(
    cfg: ModelConfig, tokenizer_size: int, max_seq_len: int, tokenizer_dir: str = ""
) -> None:
    """Fail before any data or weights are loaded if the tokenizer or the sequence length
    exceeds the model: a token id past the vocabulary is an IndexError deep in the
    embedding, a position past ``max_position_embeddings`` silently garbage.

    Models built from config get ``vocab_size = tokenizer_size``, and their positions are
    checked by config validation; here it is the loaded config of ``model.path``.
    """
    if not cfg.path:
        return
    path = Path(cfg.path)
    config = _local_config(path)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and tokenizer_size > vocab:
        raise ConfigError(
            f"the tokenizer{f' at {tokenizer_dir}' if tokenizer_dir else ''} has "
            f"{tokenizer_size} tokens, but the model at model.path={path} has vocab_size "
            f"{vocab} (config.json): token ids >= {vocab} have no embedding; use the model's "
            "own tokenizer (leave data.tokenizer_path empty) or a model with a larger vocabulary."
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_seq_len > positions:
        raise ConfigError(
            f"data.max_seq_len ({max_seq_len}) must be <= the max_position_embeddings "
            f"({positions}) of the model at model.path={path}; lower data.max_seq_len."
        )


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    special_tokens: dict[str, int] | None = None,
    *,
    on_meta: bool = False,
    buffers: bool = False,
) -> PreTrainedModel:
    """Build the model of ``cfg`` on CPU in ``cfg.dtype``, deterministically.

    ``special_tokens`` maps ``pad_token_id``/``bos_token_id``/``eos_token_id``
    to ids of the tokenizer, so exports carry a consistent config. ``on_meta``
    builds the same structure without storage or weights (no file is read): the
    ranks of a distributed run other than rank 0 do, and the parallel plan fills
    their shards from rank 0's weights, so host memory holds one full model per job.
    With ``buffers`` (``model.path`` only), ``on_meta`` keeps the buffers computed at
    construction (rotary tables) on the CPU: every rank then loads its own shards
    (``veoptim.models.sharded_load``) and no rank broadcasts.
    Both sources get ``cfg.attn_implementation`` and, with ``cfg.activation_checkpointing``,
    per decoder layer activation checkpointing, with ``cfg.compile`` compiled decoder
    layers (neither changes a parameter name). With ``cfg.quant=nf4`` the decoder's Linear
    layers are 4-bit (``veoptim.models.quant``): a ``model.path`` in safetensors is
    quantized as it is read, tensor by tensor.
    """
    dtype = resolve_dtype(cfg.dtype, "model.dtype")
    check_attn_implementation(cfg.attn_implementation)
    if cfg.attn_implementation == VARLEN:
        from veoptim.models.varlen import register_varlen

        register_varlen()  # transformers checks the name when the model is built
    model = None
    if cfg.quant == NF4 and cfg.path and not on_meta:
        model = _load_quantized(cfg, dtype)
    if model is None:
        model = _build(cfg, dtype, vocab_size, special_tokens or {}, on_meta, buffers)
        if cfg.quant == NF4:
            quantize_model(model, dtype)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.compile:
        compile_layers(model)
    return model


def _load_quantized(cfg: ModelConfig, dtype: torch.dtype) -> PreTrainedModel | None:
    """``model.path`` with its Linear layers quantized as they are read: the structure on
    meta, every other tensor read into it, each quantized weight read and quantized in
    turn. None (the caller loads it whole, then quantizes) where its safetensors files do
    not name every tensor."""
    shards = SafetensorsShards.open(cfg.path)
    with parameters_on_meta():
        config = AutoConfig.from_pretrained(Path(cfg.path))
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    if shards is None or shards.missing(model):
        log.info("model.path %s: quantizing after a full load (its weights are not all in "
                 "safetensors under their own names)", cfg.path)  # fmt: skip
        return None
    computed = {name: b.clone() for name, b in model.named_buffers()}  # rotary tables
    quantize_model(model, dtype)  # meta NF4 layers of the right shapes
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in computed:
                buffer.copy_(computed[name])
    shards.load_into(model)  # every tensor but the quantized weights
    load_quantized(model, shards.read_rows)
    return model


def _build(
    cfg: ModelConfig,
    dtype: torch.dtype,
    vocab_size: int,
    special_tokens: dict[str, int],
    on_meta: bool,
    buffers: bool,
) -> PreTrainedModel:
    attn = cfg.attn_implementation
    if cfg.path:
        path = Path(cfg.path)
        _local_config(path)  # a clear ConfigError for a directory that is not a model
        if on_meta and buffers:
            with parameters_on_meta():
                config = AutoConfig.from_pretrained(path)
                return AutoModelForCausalLM.from_config(
                    config, dtype=dtype, attn_implementation=attn
                )
        if on_meta:
            with torch.device("meta"):
                config = AutoConfig.from_pretrained(path)
                # No .to(dtype): like from_pretrained on rank 0, keep the buffers' own dtype
                # (rotary inv_freq stays FP32), or rank 0's buffer broadcast mismatches.
                return AutoModelForCausalLM.from_config(
                    config, dtype=dtype, attn_implementation=attn
                )
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    hf_config = _hf_config(cfg, vocab_size, special_tokens)
    _, model_cls = SUPPORTED_ARCHS[cfg.arch]
    if on_meta:
        with torch.device("meta"):
            return model_cls(hf_config).to(dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = model_cls(hf_config)
    return model.to(dtype)
