"""Preference pairs JSONL: the accepted shapes, labels on the final response only, and
line-numbered errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts import make_assets
from veoptim.data import load_tokenizer
from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS
from veoptim.data.pairs import collate_pairs, load_pair_dataset, read_pairs
from veoptim.data.paths import bundled_dataset_path, bundled_pairs_path
from veoptim.errors import DataError


def write(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def labelled_text(tokenizer, example) -> str:
    keep = example[LABELS] != IGNORE_INDEX
    return tokenizer.decode(example[INPUT_IDS][keep])


def test_every_record_shape_reads_and_labels_only_the_response(tmp_path):
    tokenizer = load_tokenizer()
    path = write(
        tmp_path,
        [
            {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"},
            {
                "messages": [
                    {"role": "user", "content": "Repeat \"cat\""},
                    {"role": "assistant", "content": "cat"},
                    {"role": "user", "content": "Uppercase \"dog\""},
                ],
                "chosen": {"role": "assistant", "content": "DOG"},
                "rejected": [{"role": "assistant", "content": "dog"}],
            },
            {"prompt": [{"role": "user", "content": "Reverse \"emu\""}], "chosen": "ume",
             "rejected": "emu", "score": 1},
        ],
    )  # fmt: skip
    dataset = load_pair_dataset(str(path), tokenizer, 64)
    assert len(dataset) == 3
    texts = [(labelled_text(tokenizer, i["chosen"]), labelled_text(tokenizer, i["rejected"]))
             for i in dataset.items]  # fmt: skip
    assert texts == [("5<|end|>", "6<|end|>"), ("DOG<|end|>", "dog<|end|>"),
                     ("ume<|end|>", "emu<|end|>")]  # fmt: skip
    # both sides share the context tokens before the response
    item = dataset[1]
    first_label = int((item["chosen"][LABELS] != IGNORE_INDEX).nonzero()[0])
    assert torch.equal(
        item["chosen"][INPUT_IDS][:first_label], item["rejected"][INPUT_IDS][:first_label]
    )
    batch = collate_pairs([dataset[0], dataset[1]], tokenizer.pad_token_id)
    assert batch[INPUT_IDS].shape[0] == 4
    assert torch.equal(
        batch[INPUT_IDS][1, : len(dataset[1]["chosen"][INPUT_IDS])], dataset[1]["chosen"][INPUT_IDS]
    )
    assert torch.equal(
        batch[INPUT_IDS][2, : len(dataset[0]["rejected"][INPUT_IDS])],
        dataset[0]["rejected"][INPUT_IDS],
    )


@pytest.mark.parametrize(
    "record,match",
    [
        ('{"prompt": "x", "chosen": "a"', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"prompt": "x", "chosen": "a"}, r"'rejected'\] missing"),
        ({"chosen": "a", "rejected": "b"}, "expected a 'prompt'"),
        ({"prompt": "x", "chosen": 3, "rejected": "b"}, "'chosen' to be a string"),
        ({"prompt": "x", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
         "'rejected'.*end with an 'assistant'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
          "chosen": "a", "rejected": "b"}, "end with a 'user' message"),
        ({"prompt": "x", "chosen": ["a", "b"], "rejected": "b"}, "a list of one"),
    ],
)  # fmt: skip
def test_bad_records_name_file_and_line(tmp_path, record, match):
    good = {"prompt": "x", "chosen": "a", "rejected": "b"}
    path = write(tmp_path, [good, "", record])
    with pytest.raises(DataError, match=match) as info:
        read_pairs(path)
    assert f"{path}:3" in str(info.value)


def test_pairs_losing_a_response_to_truncation_are_skipped(tmp_path, caplog):
    tokenizer = load_tokenizer()
    long_prompt = 'Repeat "' + " ".join(["cat"] * 30) + '"'
    path = write(tmp_path, [{"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"},
                            {"prompt": long_prompt, "chosen": "cat", "rejected": "dog"}])  # fmt: skip
    dataset = load_pair_dataset(str(path), tokenizer, 24)
    assert len(dataset) == 1
    assert "lose a whole response" in caplog.text and "lines [2]" in caplog.text
    with pytest.raises(DataError, match="too short to hold any response"):
        load_pair_dataset(
            str(write(tmp_path, [{"prompt": long_prompt, "chosen": "a", "rejected": "b"}])),
            tokenizer,
            24,
        )


def test_bundled_pairs_are_reproducible_and_disagree():
    assert make_assets.make_pairs(bundled_dataset_path()) == [
        json.loads(line) for line in bundled_pairs_path().read_text().splitlines()
    ]
    pairs = read_pairs(bundled_pairs_path())
    assert len(pairs) == 3000
    assert all(p.chosen["content"] != p.rejected["content"] for p in pairs)
