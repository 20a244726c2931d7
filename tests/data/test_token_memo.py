"""Tokenized conversations kept in the process: a repeated read gives the same tokens as a
first one without rendering again, and anything that changes the tokens is a new read."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from veoptim.data import load_sft_dataset, load_tokenizer
from veoptim.data.paths import bundled_dataset_path
from veoptim.data.records import read_conversations
from veoptim.data.sft import tokenize_conversations
from veoptim.data.token_memo import TOKENIZED, TokenMemo, memo_key

MAX_LEN = 64
CHATS = [
    {"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
    for w in ("one", "two", "three", "four", "five", "six")
]


@pytest.fixture(autouse=True)
def empty_memo():
    TOKENIZED.clear()
    yield
    TOKENIZED.clear()


def tokens(dataset) -> list[tuple[list[int], list[int]]]:
    return [(x["input_ids"].tolist(), x["labels"].tolist()) for x in dataset.items]


def test_a_second_read_reuses_the_tokens_bitwise_and_renders_nothing(
    tokenizer, write_jsonl, monkeypatch, caplog
):
    path = write_jsonl(CHATS)
    first = load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False)
    assert (TOKENIZED.hits, TOKENIZED.misses) == (0, 1)

    def no_render(*args, **kwargs):
        raise AssertionError("rendered a chat template again")

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", no_render)
    with caplog.at_level("INFO", logger="veoptim.data.sft"):
        again = load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False)
    assert (TOKENIZED.hits, TOKENIZED.misses) == (1, 1)
    assert "tokenized earlier in this process" in caplog.text
    assert tokens(again) == tokens(first)
    assert again.fingerprint == first.fingerprint and again.truncation == first.truncation
    for a, b in zip(first.items, again.items, strict=True):
        assert a["input_ids"].dtype == b["input_ids"].dtype == torch.long


def test_each_read_gets_its_own_tensors(tokenizer, write_jsonl):
    path = write_jsonl(CHATS)
    first = load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False)
    expected = tokens(first)
    first.items[0]["input_ids"].fill_(7)  # a consumer that writes into its examples
    second = load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False)
    second.items[1]["labels"].fill_(7)
    third = load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False)
    assert tokens(second)[0] == expected[0]
    assert tokens(third) == expected
    assert TOKENIZED.hits == 2


def test_what_changes_the_tokens_is_tokenized_afresh(tokenizer, write_jsonl):
    path = write_jsonl(CHATS)
    base = tokens(load_sft_dataset(str(path), tokenizer, MAX_LEN, packing=False))

    edited = copy.deepcopy(CHATS)
    edited[2]["messages"][1]["content"] = "3"
    other = tokens(load_sft_dataset(str(write_jsonl(edited, "e.jsonl")), tokenizer, MAX_LEN, False))
    assert other != base and other[:2] == base[:2]

    short = load_sft_dataset(str(path), tokenizer, 12, packing=False)
    assert all(len(ids) <= 12 for ids, _ in tokens(short)) and short.truncation.num_truncated

    templated = load_tokenizer()
    templated.chat_template = templated.chat_template.replace("<|user|>{{", "<|system|>{{")
    assert memo_key([], templated) != memo_key([], tokenizer)
    changed = tokens(load_sft_dataset(str(path), templated, MAX_LEN, packing=False))
    assert changed != base
    assert (TOKENIZED.hits, TOKENIZED.misses) == (0, 4)


def test_the_same_messages_from_another_file_or_layout_share_one_tokenization(
    tokenizer, write_jsonl
):
    """The key is the messages, not where they came from: a ShareGPT file with the same
    conversations is the same tokens (and the file named in errors is the caller's)."""
    sharegpt = [
        {"conversations": [{"from": "human", "value": c["messages"][0]["content"]},
                           {"from": "gpt", "value": c["messages"][1]["content"]}]}
        for c in CHATS
    ]  # fmt: skip
    a = load_sft_dataset(str(write_jsonl(CHATS)), tokenizer, MAX_LEN, packing=False)
    b = load_sft_dataset(str(write_jsonl(sharegpt, "s.jsonl")), tokenizer, MAX_LEN, False)
    assert tokens(a) == tokens(b) and TOKENIZED.hits == 1


def test_the_bundled_data_reread_equals_a_fresh_tokenization(tokenizer):
    conversations = read_conversations(bundled_dataset_path())
    first, cut = tokenize_conversations(conversations, tokenizer, 96, bundled_dataset_path())
    again, cut_again = tokenize_conversations(conversations, tokenizer, 96, bundled_dataset_path())
    assert cut == cut_again and len(first) == len(again) == len(conversations)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(first, again, strict=True) for k in x)
    assert TOKENIZED.hits == 1


def test_only_the_last_few_and_small_enough_are_kept():
    memo = TokenMemo(max_entries=2, max_tokens=10)
    for key in ("a", "b", "c"):
        memo.put(key, [[1, 2], [3]], [[-100, 2], [3]], key)
    assert memo.get("a") is None  # the oldest went
    ids, labels, summary = memo.get("c")
    assert [x.tolist() for x in ids] == [[1, 2], [3]] and summary == "c"
    assert [x.tolist() for x in labels] == [[-100, 2], [3]]
    memo.put("big", [list(range(11))], [list(range(11))], None)
    assert memo.get("big") is None  # more than max_tokens: not kept
    memo.put("empty", [], [], None)
    assert memo.get("empty") == ([], [], None)


def test_the_key_covers_every_setting_and_message(tokenizer):
    chats = [c["messages"] for c in CHATS]
    key = memo_key(chats, tokenizer, max_seq_len=8)
    assert key == memo_key(json.loads(json.dumps(chats)), tokenizer, max_seq_len=8)
    assert key != memo_key(chats, tokenizer, max_seq_len=9)
    assert key != memo_key(chats[:-1], tokenizer, max_seq_len=8)
    assert key != memo_key(chats[::-1], tokenizer, max_seq_len=8)
    assert key != memo_key(chats, tokenizer, max_seq_len=8, train_tool_turns=True)
