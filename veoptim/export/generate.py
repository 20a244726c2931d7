"""Generate text with an export (``veoptim-generate``): an HF or merged export, or a base
plus a PEFT adapter directory, loaded with plain ``transformers`` (and ``peft``).

Each prompt is one chat (a user turn, or a list of messages) rendered with the
tokenizer's chat template and its generation prompt, or raw text with
``chat_template=False``; decoding is ``model.generate``: greedy with
``temperature=0``, else sampled with ``temperature`` and ``top_p`` from ``seed``.
Prompts are decoded one at a time (no padding), so a greedy reply is exactly what
``transformers`` gives that prompt alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from veoptim.errors import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Chat = list[dict[str, str]]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateOptions:
    """How to decode: greedy (``temperature=0``) or sampled."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}.")


@dataclass(frozen=True)
class Completion:
    """One prompt's reply: its text and the generated token ids (the prompt's excluded)."""

    prompt: str | Chat
    text: str
    token_ids: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "completion": self.text, "token_ids": self.token_ids}


def _is_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def adapter_base(adapter: Path) -> Path:
    """The base model directory an adapter's ``adapter_config.json`` names."""
    config = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    named = config.get("base_model_name_or_path") or ""
    if not named or not (Path(named) / MODEL_CONFIG).is_file():
        raise ConfigError(
            f"the adapter {adapter} names its base as {named!r}, which is not a model directory "
            "here; pass the base model directory (veoptim-generate BASE --adapter ADAPTER)."
        )
    return Path(named)


def load_model(
    model: str | Path,
    adapter: str | Path | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
    *,
    allow_other_base: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """The model (with the adapter applied, when given) in eval mode, and its tokenizer.

    ``model`` is an HF or merged export (any ``save_pretrained`` directory), or a PEFT
    adapter directory whose ``adapter_config.json`` names its base. The tokenizer comes
    from the adapter directory when it has one, else from the model. A veoptim adapter is
    checked against the base it was trained on (``veoptim_base.json``: config, layout and
    content hash); another base is refused unless ``allow_other_base``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    model, adapter = Path(model), Path(adapter) if adapter else None
    if adapter is None and _is_adapter(model) and not (model / MODEL_CONFIG).is_file():
        model, adapter = adapter_base(model), model
    if not (model / MODEL_CONFIG).is_file():
        raise ConfigError(
            f"{model} is neither a Hugging Face model directory (no {MODEL_CONFIG}) nor a PEFT "
            f"adapter directory (no {ADAPTER_CONFIG}): pass an export such as "
            "runs/sft/exports/hf_final, or a LoRA export such as runs/sft/exports/lora_final."
        )
    if adapter is not None and not _is_adapter(adapter):
        raise ConfigError(f"{adapter} is not a PEFT adapter directory (no {ADAPTER_CONFIG}).")
    if adapter is not None:
        _check_base(model, adapter, allow_other_base)
    has_tokenizer = adapter is not None and (adapter / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(adapter if has_tokenizer else model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype])
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, str(adapter))
    return net.to(device).eval(), tokenizer


def _check_base(model: Path, adapter: Path, allow_other_base: bool) -> None:
    """The adapter's recorded base against ``model``; an adapter from elsewhere (no
    record) cannot be checked, which the log says."""
    from veoptim.lora.peft_format import BASE_FINGERPRINT_FILE, check_adapter_base

    if not (adapter / BASE_FINGERPRINT_FILE).is_file():
        log.warning("%s records no base (not a veoptim export): its base is not checked", adapter)
        return
    check_adapter_base(adapter, model, allow_other=allow_other_base)


def read_prompts(path: str | Path) -> list[str | Chat]:
    """Prompts of a JSONL file: per line ``{"prompt": "..."}`` or ``{"messages": [...]}``
    (a chat whose reply is generated: an assistant turn at its end is left out)."""
    prompts: list[str | Chat] = []
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist.")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number} is not JSON ({error.msg}).") from error
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            chat = list(row["messages"])
            if chat[-1].get("role") == "assistant":
                chat = chat[:-1]
            prompts.append(chat)
        else:
            raise ConfigError(
                f"{path}:{number} has neither a 'prompt' string nor a 'messages' list."
            )
    return prompts


def encode(tokenizer: Any, prompt: str | Chat, chat_template: bool = True) -> torch.Tensor:
    """The prompt's input ids, ``[1, n]``: the chat template with its generation prompt."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise ConfigError("a 'messages' prompt needs the chat template.")
        return tokenizer(prompt, return_tensors="pt")["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {tokenizer.name_or_path} has no chat template; pass raw text "
            "prompts with --no-chat-template."
        )
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Iterable[str | Chat],
    options: GenerateOptions = GenerateOptions(),
) -> list[Completion]:
    """Each prompt's reply, decoded one prompt at a time."""
    options.check()
    device = next(model.parameters()).device
    sample = options.temperature > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs: dict[str, Any] = dict(
        max_new_tokens=options.max_new_tokens,
        do_sample=sample,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    if sample:
        kwargs.update(temperature=options.temperature, top_p=options.top_p, top_k=0)
    else:  # greedy: no sampling knobs (the model's generation_config may carry some)
        kwargs.update(temperature=None, top_p=None, top_k=None)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(options.seed)
    out = []
    try:
        for prompt in prompts:
            ids = encode(tokenizer, prompt, options.chat_template).to(device)
            tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)[
                0, ids.shape[1] :
            ].tolist()
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            out.append(Completion(prompt, text, tokens))
    finally:
        torch.random.set_rng_state(generator_state)
    return out
