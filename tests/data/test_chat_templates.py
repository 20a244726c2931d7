"""``data.chat_template``: a named template or a Jinja file instead of the tokenizer's own.

Real tokenizers: the bundled one, and the bundled one with the named templates' special
tokens added (as Qwen2's and Llama 3's tokenizers have them), saved and loaded from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from veoptim.data import bundled_tokenizer_dir, load_tokenizer
from veoptim.data.chat_templates import TEMPLATES
from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS
from veoptim.data.sft import encode_conversations
from veoptim.errors import ConfigError, DataError

FAMILY_TOKENS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]  # fmt: skip
CHAT = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4+4?"},
    {"role": "assistant", "content": "8"},
]
RENDERED = {
    "chatml": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n",
    "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnd 4+4?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n8<|eot_id|>",
}
#: The trained text of each assistant turn: the answer and the turn's end.
TRAINED = {"chatml": ["5<|im_end|>\n", "8<|im_end|>\n"], "qwen2": ["5<|im_end|>\n", "8<|im_end|>\n"],
           "llama3": ["5<|eot_id|>", "8<|eot_id|>"]}  # fmt: skip


@pytest.fixture(scope="module")
def family_tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled tokenizer with the named templates' turn tokens as special tokens."""
    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir(), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS})
    out = tmp_path_factory.mktemp("family_tokenizer")
    tok.save_pretrained(out)
    return out


def _trained_texts(tok, encoded) -> list[str]:
    ids, labels = encoded[INPUT_IDS][0], encoded[LABELS][0]
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(token)
    if current:
        runs.append(current)
    return [tok.decode(run) for run in runs]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_named_template_renders_trains_the_answers_and_ends_turns_with_its_eos(
    family_tokenizer_dir, name
):
    tok = load_tokenizer(str(family_tokenizer_dir), chat_template=name)
    assert tok.apply_chat_template(CHAT, tokenize=False) == RENDERED[name]
    assert tok.eos_token == TEMPLATES[name].end_of_turn
    encoded = encode_conversations([CHAT], ["chat"], tok, max_seq_len=512)
    assert _trained_texts(tok, encoded) == TRAINED[name]
    # transformers' own assistant mask (the template's {% generation %}) marks the answers too
    marked = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    mask_ids = [t for t, m in zip(marked["input_ids"], marked["assistant_masks"], strict=True) if m]
    assert tok.decode(mask_ids).replace("\n", "") == "".join(TRAINED[name]).replace("\n", "")


def test_a_template_file_replaces_the_tokenizers_own(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text(
        "{%- for m in messages -%}[{{ m['role'] }}] {{ m['content'] }}<|end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}[assistant] {%- endif -%}"
    )
    tok = load_tokenizer(chat_template=str(template))
    assert tok.apply_chat_template(CHAT[:2], tokenize=False) == (
        "[user] What is 2+3?<|end|>[assistant] 5<|end|>"
    )
    assert tok.eos_token == "<|end|>"  # a file leaves the tokenizer's tokens alone


def test_an_unknown_name_is_refused_in_one_line_listing_the_known_ones():
    with pytest.raises(ConfigError) as error:
        load_tokenizer(chat_template="vicuna")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("data.chat_template='vicuna' is not a known template; known: ")
    assert "chatml, llama3, qwen2" in message


def test_a_missing_template_file_is_refused_naming_it(tmp_path):
    with pytest.raises(DataError, match="data.chat_template=.*nowhere.jinja: expected a readable"):
        load_tokenizer(chat_template=str(tmp_path / "nowhere.jinja"))


def test_a_named_template_needs_its_turn_token_in_the_tokenizer():
    with pytest.raises(DataError, match=r"chatml ends each turn with <\|im_end\|>, which the tok"):
        load_tokenizer(chat_template="chatml")


def test_no_choice_keeps_the_tokenizers_template():
    assert load_tokenizer().chat_template == load_tokenizer(chat_template="").chat_template
