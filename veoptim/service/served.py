"""What the served base model is to a client: its name, vocabulary, context, tokenizer and
the modules its slots adapt; and the checks of a request against them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.data import bundled_tokenizer_dir
from veoptim.data.tokenizer import tokenizer_source
from veoptim.service.config import ServeConfig
from veoptim.service.errors import ServiceError

#: lora_config flag -> the module names it adapts.
FAMILIES = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients pass as base_model (serve.base_model, default model.name)
    tokenizer_dir: str
    vocab: int
    max_tokens: int  # data.max_seq_len
    arch: str
    max_rank: int  # lora.r
    target_modules: tuple[str, ...]
    eos_token_id: int | None

    @classmethod
    def of(cls, cfg: ServeConfig, trainer: Any) -> ServedModel:
        directory, _ = tokenizer_source(cfg.data.tokenizer_path, cfg.model.path)
        eos = trainer.tokenizer.eos_token_id
        return cls(
            name=cfg.serve.base_model or cfg.model.name,
            tokenizer_dir=str(Path(directory or bundled_tokenizer_dir()).resolve()),
            vocab=int(trainer.model.config.vocab_size),
            max_tokens=int(cfg.data.max_seq_len),
            arch=str(getattr(trainer.model.config, "model_type", "")),
            max_rank=int(cfg.lora.r),
            target_modules=tuple(cfg.lora.target_modules),
            eos_token_id=None if eos is None else int(eos),
        )

    @property
    def families(self) -> dict[str, bool]:
        """Which lora_config flags this server's slots adapt."""
        return {
            flag: bool(set(self.target_modules) & set(names)) for flag, names in FAMILIES.items()
        }

    def check_name(self, base_model: str | None, field: str = "base_model") -> None:
        if base_model is not None and base_model != self.name:
            raise ServiceError(
                f"{field} {base_model!r} is not served here; this server trains [{self.name!r}]."
            )

    def check_tokens(self, tokens: Sequence[int] | Any, field: str) -> None:
        """Refuse token ids outside the vocabulary (numpy arrays or lists)."""
        if not len(tokens):
            return
        low, high = (
            (tokens.min(), tokens.max()) if hasattr(tokens, "min") else (min(tokens), max(tokens))
        )
        if low < 0 or high >= self.vocab:
            raise ServiceError(f"{field} holds token ids outside the vocabulary [0, {self.vocab}).")
