"""Own data as ``.jsonl`` in every layout of the one layout table: Alpaca, ShareGPT and
prompt/completion lines are read by the JSONL reader into exactly the examples the same
rows give as ``.json`` through ``datasets``, and train; a line that fits no layout, and an
empty ``.json`` file, say so in one sentence."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_sft_cli
from tests.data.test_hf_datasets import (
    ALPACA,
    ALPACA_CHATS,
    SHAREGPT,
    SHAREGPT_CHATS,
    assert_same_examples,
    hf_cache,  # noqa: F401  (autouse: a datasets cache of each test's own)
    load,
    write_chats,
)
from veoptim.data.conversation_shapes import LAYOUTS
from veoptim.errors import DataError

pytestmark = pytest.mark.slow

PROMPT_COMPLETION = [
    {"prompt": "What is 2+3?", "completion": "5"},
    {"prompt": "Reverse snow", "completion": "wons"},
    {"prompt": "Uppercase bat", "completion": "BAT"},
]
PROMPT_COMPLETION_CHATS = [
    [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
    for r in PROMPT_COMPLETION
]
OWN_DATA = {
    "alpaca": (ALPACA, ALPACA_CHATS),
    "sharegpt": (SHAREGPT, SHAREGPT_CHATS),
    "prompt_completion": (PROMPT_COMPLETION, PROMPT_COMPLETION_CHATS),
}


@pytest.mark.parametrize("layout", sorted(OWN_DATA))
def test_own_jsonl_reads_like_its_json_and_its_messages(layout, tokenizer, tmp_path, write_jsonl):
    rows, chats = OWN_DATA[layout]
    from_jsonl = load(write_jsonl(rows, f"{layout}.jsonl"), tokenizer)
    assert from_jsonl.token_cache is None  # the JSONL reader read it, not datasets
    as_json = tmp_path / f"{layout}.json"
    as_json.write_text(json.dumps(rows))
    from_json = load(as_json, tokenizer)
    assert from_json.token_cache is not None  # datasets read the .json
    assert_same_examples(from_jsonl, from_json)
    assert_same_examples(from_jsonl, load(write_chats(write_jsonl, chats), tokenizer))


def test_one_jsonl_may_mix_the_layouts(tokenizer, write_jsonl):
    rows = [ALPACA[1], SHAREGPT[1], PROMPT_COMPLETION[2], {"messages": ALPACA_CHATS[0]}]
    chats = [ALPACA_CHATS[1], SHAREGPT_CHATS[1], PROMPT_COMPLETION_CHATS[2], ALPACA_CHATS[0]]
    assert_same_examples(
        load(write_jsonl(rows, "mixed.jsonl"), tokenizer),
        load(write_chats(write_jsonl, chats), tokenizer),
    )


def test_source_jsonl_reads_a_named_layout_with_renamed_keys(tokenizer, write_jsonl):
    renamed = [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in ALPACA]
    path = write_jsonl(renamed, "qa.jsonl")
    columns = {"instruction": "q", "input": "ctx", "output": "a"}
    via_reader = load(path, tokenizer, source="jsonl", layout="alpaca", columns=columns)
    assert via_reader.token_cache is None
    assert_same_examples(via_reader, load(path, tokenizer, layout="alpaca", columns=columns))


def test_a_line_that_fits_no_layout_names_the_layouts_and_the_keys(tokenizer, write_jsonl):
    qa = [{"question": "2+3?", "answer": "5"}, {"question": "Reverse cat", "answer": "tac"}]
    path = write_jsonl(qa, "qa.jsonl")
    sentence = (
        f"{path}:1: cannot tell the layout from the keys ['answer', 'question']; data.layout=auto "
        "reads 'messages' (messages), 'conversations' (sharegpt), 'instruction' and 'output' "
        "(alpaca), 'prompt' and 'response'/'completion' (prompt_response). For other names set "
        f"data.layout to one of {list(LAYOUTS)} and name your fields with "
        "data.columns.<name>=<yours> (e.g. data.layout=alpaca data.columns.instruction=question "
        "data.columns.output=answer)."
    )
    with pytest.raises(DataError) as info:
        load(path, tokenizer)
    assert str(info.value) == sentence
    # ... and the hint works: those keys read the file (through datasets, as docs/data.md says)
    got = load(
        path, tokenizer, layout="alpaca", columns={"instruction": "question", "output": "answer"}
    )
    assert got.num_examples == 2


def test_a_line_with_half_a_layout_names_the_missing_key(tokenizer, write_jsonl):
    path = write_jsonl([{"instruction": "Reverse snow", "answer": "wons"}], "half.jsonl")
    with pytest.raises(DataError, match=re.escape(f"{path}:1: 'output' is missing")) as info:
        load(path, tokenizer)
    assert "data.layout=alpaca data.columns.output=<your key>" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n  \n", "[]"])
def test_an_empty_json_file_says_it_is_empty(content, tokenizer, tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(content)
    message = f"SFT data file {path} is empty: it holds no rows"
    with pytest.raises(DataError, match=re.escape(message)):
        load(path, tokenizer)


def test_alpaca_sharegpt_and_prompt_completion_jsonl_train(tmp_path, tiny_overrides, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [row for rows, _ in OWN_DATA.values() for row in rows]
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 2))
    proc = run_sft_cli(
        [*tiny_overrides, f"data.train_path={path}", "data.max_seq_len=128"], tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in records)
    assert not (tmp_path / "hf_cache" / "veoptim_sft").exists()  # the JSONL reader, no datasets
