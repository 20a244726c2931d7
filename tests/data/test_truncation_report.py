"""data.max_seq_len truncation is reported at startup (a warning above 5 %), and a length
that cuts every response fails as a DataError naming the length it needs."""

from __future__ import annotations

import logging

import pytest

from veoptim.data import load_sft_dataset
from veoptim.errors import DataError

SHORT = {"prompt": "Hi", "response": "ok"}
LONG_RESPONSE = {"prompt": "Hi", "response": "word " * 20}  # truncated inside the response
LONG_PROMPT = {"prompt": "word " * 20, "response": "ok"}  # truncated before the response


def _messages(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "veoptim.data.sft"]


def test_few_truncated_examples_are_logged_as_info(tokenizer, write_jsonl, caplog):
    path = write_jsonl([SHORT] * 39 + [LONG_RESPONSE])
    with caplog.at_level(logging.INFO, logger="veoptim"):
        dataset = load_sft_dataset(str(path), tokenizer, 32, packing=False)
    assert dataset.num_truncated == 1
    [(level, message)] = _messages(caplog)
    assert level == logging.INFO
    assert "1 of 40 examples (2.5%)" in message and "data.max_seq_len=32" in message


def test_more_than_five_percent_truncated_is_a_warning(tokenizer, write_jsonl, caplog):
    path = write_jsonl([SHORT] * 9 + [LONG_RESPONSE])
    with caplog.at_level(logging.INFO, logger="veoptim"):
        load_sft_dataset(str(path), tokenizer, 32, packing=True)
    [(level, message)] = _messages(caplog)
    assert level == logging.WARNING
    assert "1 of 10 examples (10.0%)" in message and "raise data.max_seq_len" in message


def test_examples_that_lose_their_whole_response_are_a_warning(tokenizer, write_jsonl, caplog):
    path = write_jsonl([SHORT] * 99 + [LONG_PROMPT])
    with caplog.at_level(logging.INFO, logger="veoptim"):
        dataset = load_sft_dataset(str(path), tokenizer, 12, packing=False)
    assert dataset.truncation.num_without_response == 1
    [(level, message)] = _messages(caplog)
    assert level == logging.WARNING and "1 of them keep no response token" in message


def test_max_seq_len_too_short_for_any_response_is_a_data_error(tokenizer, write_jsonl):
    """It used to load, and the trainer failed later on a global batch with no response."""
    path = write_jsonl([SHORT, LONG_PROMPT])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    need = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # the prompt's tokens
    with pytest.raises(DataError, match=rf"data\.max_seq_len=4 is too short.*>= {need + 1}"):
        load_sft_dataset(str(path), tokenizer, 4, packing=False)
    assert len(load_sft_dataset(str(path), tokenizer, need + 1, packing=False)) == 2
