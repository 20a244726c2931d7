"""Chat templates chosen by name or file (``data.chat_template``), instead of another tokenizer.

A name selects one of :data:`TEMPLATES` (ChatML, Qwen2's ChatML with its default system
prompt, Llama 3's headers); anything with a ``/`` or ending in ``.jinja`` is a Jinja file.
The template replaces the tokenizer's own, so training renders with it and every export
that saves the tokenizer (HF exports, and PEFT adapter directories of such a run) carries
it: ``veoptim-generate`` and plain ``transformers`` then render prompts identically.

A named template ends each turn with its own token (``<|im_end|>``, ``<|eot_id|>``). It
becomes the tokenizer's EOS, as in the instruct models these templates come from, so
generation stops at the end of a turn; the tokenizer must therefore have it as one token
(Qwen2's and Llama 3's tokenizers do; the bundled one does not: give it a template file).
Every named template marks the trained span with ``{% generation %}``, so transformers'
``return_assistant_tokens_mask`` agrees with veoptim's labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from veoptim.errors import ConfigError, DataError

KEY = "data.chat_template"


@dataclass(frozen=True)
class NamedTemplate:
    """A template and the token that ends each of its turns (the tokenizer's EOS with it)."""

    jinja: str
    end_of_turn: str


def _chatml(default_system: str = "") -> str:
    system = (
        "{%- if not messages or messages[0]['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
        "{%- endif -%}"
        if default_system
        else ""
    )
    return (
        system + "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' -%}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
        "{%- else -%}{{ message['content'] + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


_LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else -%}{{ message['content'] | trim + '<|eot_id|>' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)

#: The named templates ``data.chat_template`` knows.
TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate(_chatml(), "<|im_end|>"),
    "qwen2": NamedTemplate(_chatml("You are a helpful assistant."), "<|im_end|>"),
    "llama3": NamedTemplate(_LLAMA3, "<|eot_id|>"),
}


def is_template_file(choice: str) -> bool:
    """A ``data.chat_template`` value that names a file rather than a template."""
    return "/" in choice or choice.endswith(".jinja")


def check_choice(choice: str) -> None:
    """Refuse an unknown name in one line listing the known ones (a file is read later)."""
    if choice and not is_template_file(choice) and choice not in TEMPLATES:
        raise ConfigError(
            f"{KEY}={choice!r} is not a known template; known: {', '.join(sorted(TEMPLATES))} "
            "(or a Jinja file path: one with a '/' or ending in .jinja)."
        )


def apply_choice(tokenizer: PreTrainedTokenizerBase, choice: str, where: str) -> None:
    """Give ``tokenizer`` (loaded from ``where``) the template ``choice`` names ('' keeps its own)."""
    check_choice(choice)
    if not choice:
        return
    if is_template_file(choice):
        path = Path(choice)
        try:
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(
                f"{KEY}={choice}: expected a readable Jinja template file, found "
                f"{type(error).__name__}: {error}."
            ) from error
        return
    named = TEMPLATES[choice]
    token_id = tokenizer.get_vocab().get(named.end_of_turn)
    if token_id is None:
        raise DataError(
            f"{KEY}={choice} ends each turn with {named.end_of_turn}, which the tokenizer at "
            f"{where} has no token for; use that model family's tokenizer "
            "(data.tokenizer_path) or a Jinja file of your own."
        )
    tokenizer.chat_template = named.jinja
    tokenizer.eos_token = named.end_of_turn
