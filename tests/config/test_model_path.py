"""model=hf_local with a real local HF directory (written by transformers' save_pretrained):
the tokenizer comes from it, and a tokenizer or sequence length the model cannot take is
refused before training instead of an IndexError deep in the embedding."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tasks.runner import run_task
from tests.conftest import compose_sft
from veoptim.config import to_config
from veoptim.data import bundled_tokenizer_dir, load_tokenizer
from veoptim.distributed import init_distributed
from veoptim.errors import ConfigError, DataError
from veoptim.trainer import Trainer

EXTRA_TOKENS = ["<|extra_a|>", "<|extra_b|>", "<|extra_c|>"]
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _model_dir(
    path: Path,
    *,
    vocab_size: int | None = None,
    max_positions: int = 128,
    arch: str = "qwen2",
    extra_tokens: bool = True,
    tokenizer: bool = True,
) -> Path:
    """A tiny model saved like a downloaded one: config.json, weights and its own tokenizer
    (the bundled one plus three tokens, so it is told apart from the bundled tokenizer)."""
    tok = load_tokenizer()
    if extra_tokens:
        tok.add_tokens(EXTRA_TOKENS)
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=vocab_size or len(tok),
        max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **TINY,
    )
    model_cls(config).save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return path


def _trainer(tmp_path: Path, tiny_overrides: list[str], path: Path, *extra: str) -> Trainer:
    overrides = [*tiny_overrides, "model=hf_local", f"model.path={path}", *extra]
    cfg = to_config(compose_sft(overrides))
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def test_tokenizer_comes_from_model_path(tmp_path, tiny_overrides):
    path = _model_dir(tmp_path / "model")
    trainer = _trainer(tmp_path, tiny_overrides, path)
    assert len(trainer.tokenizer) == len(load_tokenizer()) + len(EXTRA_TOKENS)
    assert Path(trainer.tokenizer.name_or_path) == path
    bundled = f"data.tokenizer_path={bundled_tokenizer_dir()}"  # an explicit path still wins
    assert len(_trainer(tmp_path, tiny_overrides, path, bundled).tokenizer) == len(load_tokenizer())


def test_model_path_without_a_tokenizer_says_to_set_data_tokenizer_path(tmp_path, tiny_overrides):
    path = _model_dir(tmp_path / "model", tokenizer=False, extra_tokens=False)
    with pytest.raises(DataError, match=r"\(model\.path\).*set data\.tokenizer_path"):
        _trainer(tmp_path, tiny_overrides, path)


def test_tokenizer_larger_than_the_vocabulary_is_rejected_with_both_sizes(tmp_path, tiny_overrides):
    path = _model_dir(tmp_path / "model", vocab_size=256, tokenizer=False, extra_tokens=False)
    bundled = f"data.tokenizer_path={bundled_tokenizer_dir()}"
    with pytest.raises(ConfigError, match=r"has 512 tokens.*vocab_size 256"):
        _trainer(tmp_path, tiny_overrides, path, bundled)


def test_max_seq_len_beyond_the_loaded_models_positions_is_rejected(tmp_path, tiny_overrides):
    """model.max_position_embeddings (512) is the built model's; model.path has its own."""
    path = _model_dir(tmp_path / "model", max_positions=64)
    with pytest.raises(
        ConfigError, match=r"data\.max_seq_len \(96\).*max_position_embeddings \(64\)"
    ):
        _trainer(tmp_path, tiny_overrides, path)
    assert _trainer(tmp_path, tiny_overrides, path, "data.max_seq_len=64").model is not None


def test_startup_log_names_the_loaded_architecture(tmp_path, tiny_overrides, caplog):
    path = _model_dir(tmp_path / "llama", arch="llama")
    overrides = [*tiny_overrides, "model=hf_local", f"model.path={path}", "train.max_steps=1"]
    with caplog.at_level(logging.INFO, logger="veoptim"):
        run_task(compose_sft(overrides))
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training ")]
    # The model's own path, not the preset's label (hf_local, or tiny_dense without model=).
    assert len(started) == 1 and started[0].startswith(f"training {path} (llama,"), started


def test_generic_tokenizer_next_to_a_qwen2_config_keeps_its_size(tmp_path):
    """AutoTokenizer would route by model_type to Qwen2Tokenizer, which adds <|endoftext|>:
    the bundled tokenizer of an exported model loaded with 513 tokens for a 512 vocabulary."""
    path = _model_dir(tmp_path / "model", extra_tokens=False)
    tokenizer = load_tokenizer(str(path))
    assert len(tokenizer) == len(load_tokenizer()) == 512
    assert "<|endoftext|>" not in tokenizer.get_vocab()


def test_a_training_checkpoint_as_model_path_says_to_export_it(tmp_path, tiny_overrides):
    checkpoint = tmp_path / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a veoptim training checkpoint.*veoptim-export"):
        to_config(compose_sft([*tiny_overrides, f"model.path={checkpoint}"]))


def test_the_checkpoint_marker_is_the_checkpoint_info_file():
    from veoptim.checkpoint.component import INFO_FILE
    from veoptim.config.validate import TRAINING_CHECKPOINT_FILE

    assert TRAINING_CHECKPOINT_FILE == INFO_FILE


@pytest.mark.parametrize("contents", ["empty", "tokenizer only"])
def test_a_model_path_without_config_json_is_named_as_a_model_problem(
    tmp_path, tiny_overrides, contents
):
    """An empty directory was reported as a tokenizer without tokenizer.json: the model's
    config.json is what is missing, and the error says so first, naming the directory."""
    path = tmp_path / "model"
    path.mkdir()
    if contents == "tokenizer only":
        load_tokenizer().save_pretrained(path)
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, tiny_overrides, path)
    message = str(info.value)
    assert message.startswith(f"model.path={path}: {path} has no config.json"), message
    assert "not a Hugging Face model directory" in message and "tokenizer.json" not in message
