"""SFT examples: loss only on assistant turns, formatting identical to the chat template."""

from __future__ import annotations

import json

import pytest
import torch

from veoptim.data import IGNORE_INDEX, bundled_sample_path, collate, load_sft_dataset
from veoptim.data.chat_format import END_TOKEN
from veoptim.data.paths import bundled_dataset_path

MAX_LEN = 96


@pytest.fixture(scope="module")
def bundled(tokenizer):
    return load_sft_dataset("", tokenizer, MAX_LEN, packing=False)


@pytest.fixture(scope="module")
def bundled_chats() -> list[list[dict]]:
    return [
        json.loads(line)["messages"] for line in bundled_dataset_path().read_text().splitlines()
    ]


def labelled_runs(example: dict) -> list[list[int]]:
    """Maximal runs of consecutive labelled tokens (one per trained assistant turn)."""
    runs, current = [], []
    for token, label in zip(example["input_ids"].tolist(), example["labels"].tolist(), strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return runs + ([current] if current else [])


def test_bundled_examples_fit_well_under_max_seq_len(bundled):
    assert bundled.num_examples == len(bundled) and bundled.num_truncated == 0
    assert max(len(e["input_ids"]) for e in bundled) < MAX_LEN // 2


def test_labels_decode_to_exactly_the_assistant_responses(bundled, bundled_chats, tokenizer):
    for example, chat in zip(bundled, bundled_chats, strict=True):
        decoded = [tokenizer.decode(run) for run in labelled_runs(example)]
        expected = [m["content"] + END_TOKEN for m in chat if m["role"] == "assistant"]
        assert decoded == expected


def test_input_ids_equal_the_chat_template_tokenization(bundled, bundled_chats, tokenizer):
    for example, chat in list(zip(bundled, bundled_chats, strict=True))[:300]:
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert example["input_ids"].tolist() == ids


def test_labels_agree_with_transformers_assistant_mask(bundled, bundled_chats, tokenizer):
    for example, chat in list(zip(bundled, bundled_chats, strict=True))[:300]:
        out = tokenizer.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert (example["labels"] != IGNORE_INDEX).long().tolist() == out["assistant_masks"]


def test_every_assistant_turn_of_a_multi_turn_chat_is_trained(tokenizer, write_jsonl):
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 10+11?"},
        {"role": "assistant", "content": "21"},
        {"role": "user", "content": "Reverse: pado"},
        {"role": "assistant", "content": "odap"},
    ]
    dataset = load_sft_dataset(str(write_jsonl([{"messages": chat}])), tokenizer, MAX_LEN, False)
    runs = [tokenizer.decode(run) for run in labelled_runs(dataset[0])]
    assert runs == ["21" + END_TOKEN, "odap" + END_TOKEN]


def test_prompt_response_lines_equal_the_same_one_turn_chat(tokenizer, write_jsonl):
    pairs = [json.loads(line) for line in bundled_sample_path().read_text().splitlines()]
    chats = [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["response"]},
            ]
        }
        for p in pairs
    ]
    from_pairs = load_sft_dataset(str(bundled_sample_path()), tokenizer, MAX_LEN, False)
    from_chats = load_sft_dataset(str(write_jsonl(chats)), tokenizer, MAX_LEN, False)
    assert len(from_pairs) == len(pairs) > 0
    for a, b in zip(from_pairs, from_chats, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_examples_are_truncated_to_max_seq_len(tokenizer, write_jsonl):
    # A short second example keeps a response within 16 tokens: a dataset whose every
    # response is cut off is refused (tests/data/test_truncation_report.py).
    long = {"prompt": "Repeat: " + "ka " * 40, "response": "ka " * 40}
    path = write_jsonl([long, {"prompt": "Hi", "response": "ok"}])
    full = load_sft_dataset(str(path), tokenizer, 512, False)[0]
    dataset = load_sft_dataset(str(path), tokenizer, 16, False)
    assert dataset.num_truncated == 1
    assert torch.equal(dataset[0]["input_ids"], full["input_ids"][:16])
    assert torch.equal(dataset[0]["labels"], full["labels"][:16])


def test_collate_right_pads_with_pad_id_and_ignores_padding_in_labels(bundled, tokenizer):
    examples = [bundled[i] for i in range(4)]
    batch = collate(examples, tokenizer.pad_token_id)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    width = max(len(e["input_ids"]) for e in examples)
    assert batch["input_ids"].shape == (4, width)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], example["input_ids"])
        assert torch.equal(batch["labels"][row, :n], example["labels"])
        assert (batch["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)


def test_fingerprint_follows_the_tokenized_content(tokenizer, write_jsonl):
    """Same examples (even reformatted) -> same fingerprint; an edited example or other
    max_seq_len/packing -> another (a resumed sampler position would pick other examples)."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Add {i}+1"},
                {"role": "assistant", "content": str(i + 1)},
            ]
        }
        for i in range(8)
    ]
    base = load_sft_dataset(str(write_jsonl(chats, "a.jsonl")), tokenizer, MAX_LEN, packing=False)
    spaced = write_jsonl(
        [json.dumps(c, indent=None, separators=(", ", ": ")) for c in chats], "b.jsonl"
    )
    assert load_sft_dataset(str(spaced), tokenizer, MAX_LEN, False).fingerprint == base.fingerprint
    edited = [
        *chats[:3],
        {"messages": [chats[3]["messages"][0], {"role": "assistant", "content": "5"}]},
        *chats[4:],
    ]
    other = load_sft_dataset(str(write_jsonl(edited, "c.jsonl")), tokenizer, MAX_LEN, False)
    assert len(other) == len(base) and other.fingerprint != base.fingerprint
    assert load_sft_dataset(str(spaced), tokenizer, MAX_LEN, True).fingerprint != base.fingerprint
