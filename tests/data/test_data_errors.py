"""Bad SFT data fails loudly with the file and the 1-based line number."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from veoptim.data import load_sft_dataset
from veoptim.errors import DataError

GOOD = {"prompt": "What is 10+10?", "response": "20"}
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "yo"}

BAD_LINES = {
    "invalid_json": ('{"prompt": "x", "response": ', "invalid JSON"),
    "not_an_object": ("[1, 2]", "expected a JSON object"),
    "no_known_keys": ({"text": "hello"}, r"cannot tell the layout from the keys \['text'\]"),
    "prompt_without_response": ({"prompt": "x"}, "'response' is missing"),
    "response_not_a_string": ({"prompt": "x", "response": 5}, "'response' to be a string"),
    "messages_not_a_list": ({"messages": "hi"}, "non-empty list"),
    "messages_empty": ({"messages": []}, "non-empty list"),
    "message_not_an_object": ({"messages": ["hi", ASSISTANT]}, r"messages\[0\]"),
    "unknown_role": ({"messages": [{"role": "bot", "content": "x"}, ASSISTANT]}, "role in"),
    "missing_role": ({"messages": [{"content": "x"}, ASSISTANT]}, "found None"),
    "content_not_a_string": (
        {"messages": [USER, {"role": "assistant", "content": ["x"]}]},
        "'content' to be a string",
    ),
    "system_not_first": (
        {"messages": [USER, {"role": "system", "content": "s"}, ASSISTANT]},
        "only allowed first",
    ),
    "ends_with_user": ({"messages": [USER, ASSISTANT, USER]}, "end with an 'assistant'"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_raises_data_error_naming_file_and_line(case, tokenizer, write_jsonl):
    bad, expected = BAD_LINES[case]
    path = write_jsonl([GOOD, GOOD, "", bad, GOOD])
    with pytest.raises(DataError, match=expected) as info:
        load_sft_dataset(str(path), tokenizer, 64, packing=False)
    assert f"{path}:4:" in str(info.value)


def test_invalid_utf8_line_raises_data_error_with_line(tokenizer, tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: expected UTF-8")):
        load_sft_dataset(str(path), tokenizer, 64, packing=False)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_file_without_examples_raises_data_error(content, tokenizer, tmp_path: Path):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"{re.escape(str(path))} has no examples"):
        load_sft_dataset(str(path), tokenizer, 64, packing=False)


def test_missing_file_raises_data_error(tokenizer, tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        load_sft_dataset(str(tmp_path / "nope.jsonl"), tokenizer, 64, packing=False)


def test_valid_file_with_blank_lines_loads(tokenizer, write_jsonl):
    path = write_jsonl([GOOD, "", {"messages": [USER, ASSISTANT]}, "   "])
    assert len(load_sft_dataset(str(path), tokenizer, 64, packing=False)) == 2


def test_max_seq_len_below_two_raises_data_error(tokenizer, write_jsonl):
    with pytest.raises(DataError, match="max_seq_len"):
        load_sft_dataset(str(write_jsonl([GOOD])), tokenizer, 1, packing=False)


def test_chat_template_that_is_not_prefix_stable_raises_data_error(tokenizer, write_jsonl):
    unstable = copy.deepcopy(tokenizer)
    # Prints the number of messages first, so a longer chat's render does not extend a shorter one's.
    unstable.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    path = write_jsonl([GOOD])
    with pytest.raises(
        DataError, match=re.escape(f"{path}:1: the tokenizer's chat template is not prefix-stable")
    ):
        load_sft_dataset(str(path), unstable, 64, packing=False)
