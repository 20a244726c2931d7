"""SFT data through Hugging Face ``datasets``: layouts map to exactly the JSONL reader's
examples, the tool role, save_to_disk and cached-by-name data, the tokenization cache,
``num_proc`` workers and errors that name the file and row."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.parquet.parquet import Parquet, ParquetConfig

from tests.conftest import REPO
from tests.data.test_sft_dataset import labelled_runs
from veoptim.data import IGNORE_INDEX, bundled_sample_path, load_sft_dataset
from veoptim.data.chat_format import END_TOKEN
from veoptim.data.pairs import load_pair_dataset
from veoptim.data.sources import ReadOptions
from veoptim.errors import ConfigError, DataError

pytestmark = pytest.mark.slow

MAX_LEN = 128


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


ALPACA = [
    {"instruction": "What is 2+3?", "input": "", "output": "5", "system": "", "history": []},
    {
        "instruction": "Reverse the word",
        "input": "snow",
        "output": "wons",
        "system": "Be brief.",
        "history": [],
    },
    {
        "instruction": "Uppercase",
        "input": "bat",
        "output": "BAT",
        "system": "",
        "history": [["What is 1+1?", "2"]],
    },
    {"instruction": "Repeat hen", "input": "", "output": "hen", "system": "", "history": []},
]
ALPACA_CHATS = [
    [msg("user", "What is 2+3?"), msg("assistant", "5")],
    [msg("system", "Be brief."), msg("user", "Reverse the word\nsnow"), msg("assistant", "wons")],
    [
        msg("user", "What is 1+1?"),
        msg("assistant", "2"),
        msg("user", "Uppercase\nbat"),
        msg("assistant", "BAT"),
    ],
    [msg("user", "Repeat hen"), msg("assistant", "hen")],
]


def turn(sender: str, value: str) -> dict:
    return {"from": sender, "value": value}


SHAREGPT = [
    {"conversations": [turn("human", "What is 4+4?"), turn("gpt", "8")]},
    {
        "conversations": [
            turn("system", "You can call add."),
            turn("human", "Add 2 and 3"),
            turn("function_call", '{"name": "add", "arguments": [2, 3]}'),
            turn("observation", '{"sum": 5}'),
            turn("gpt", "5"),
        ]
    },
    {
        "conversations": [
            turn("human", "Reverse cat"),
            turn("gpt", "tac"),
            turn("human", "Uppercase it"),
            turn("gpt", "TAC"),
        ]
    },
    {"conversations": [turn("user", "Say ok"), turn("assistant", "ok")]},
]
SHAREGPT_CHATS = [
    [msg("user", "What is 4+4?"), msg("assistant", "8")],
    [
        msg("system", "You can call add."),
        msg("user", "Add 2 and 3"),
        msg("assistant", '{"name": "add", "arguments": [2, 3]}'),
        msg("tool", '{"sum": 5}'),
        msg("assistant", "5"),
    ],
    [
        msg("user", "Reverse cat"),
        msg("assistant", "tac"),
        msg("user", "Uppercase it"),
        msg("assistant", "TAC"),
    ],
    [msg("user", "Say ok"), msg("assistant", "ok")],
]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch) -> Path:
    """A datasets cache of this test's own (in this process and in its subprocesses)."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    return cache


def load(path, tokenizer, max_len: int = MAX_LEN, packing: bool = False, **options):
    return load_sft_dataset(str(path), tokenizer, max_len, packing, ReadOptions(**options))


def assert_same_examples(a, b) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert set(x) == set(y)
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert a.fingerprint == b.fingerprint


def write_chats(write_jsonl, chats: list[list[dict]], name: str = "chats.jsonl") -> Path:
    return write_jsonl([{"messages": chat} for chat in chats], name)


def trained_text(tokenizer, example) -> list[str]:
    """The decoded runs of labelled tokens."""
    return [tokenizer.decode(run) for run in labelled_runs(example)]


# --- layouts: exactly the examples of the equivalent JSONL messages -----------------------


def test_alpaca_parquet_equals_the_jsonl_messages(tokenizer, tmp_path, write_jsonl):
    datasets.Dataset.from_list(ALPACA).to_parquet(tmp_path / "alpaca.parquet")
    from_parquet = load(tmp_path / "alpaca.parquet", tokenizer)
    assert from_parquet.token_cache is not None  # read by datasets, not the JSONL reader
    assert_same_examples(from_parquet, load(write_chats(write_jsonl, ALPACA_CHATS), tokenizer))


def test_sharegpt_json_equals_the_jsonl_messages(tokenizer, tmp_path, write_jsonl):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))  # one JSON array, as ShareGPT dumps are written
    assert_same_examples(
        load(path, tokenizer), load(write_chats(write_jsonl, SHAREGPT_CHATS), tokenizer)
    )


def test_renamed_columns_and_prompt_completion(tokenizer, tmp_path, write_jsonl):
    renamed = [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in ALPACA]
    datasets.Dataset.from_list(renamed).to_parquet(tmp_path / "qa.parquet")
    columns = {"instruction": "q", "input": "ctx", "output": "a"}
    got = load(tmp_path / "qa.parquet", tokenizer, layout="alpaca", columns=columns)
    plain = [[m for m in chat if m["role"] != "system"][-2:] for chat in ALPACA_CHATS]
    assert_same_examples(got, load(write_chats(write_jsonl, plain), tokenizer))
    # TRL's prompt/completion columns are the prompt_response layout
    pairs = [{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in plain]
    datasets.Dataset.from_list(pairs).to_json(tmp_path / "pc.jsonl")
    assert_same_examples(load(tmp_path / "pc.jsonl", tokenizer, source="datasets"), got)


def test_bundled_jsonl_through_datasets_equals_the_jsonl_reader(tokenizer):
    assert not ReadOptions().uses_datasets("") and not ReadOptions().uses_datasets("a.jsonl")
    via_reader = load(bundled_sample_path(), tokenizer)
    assert via_reader.token_cache is None
    assert_same_examples(load(bundled_sample_path(), tokenizer, source="datasets"), via_reader)


# --- the tool role ---------------------------------------------------------------------------

TOOL_CHAT = SHAREGPT_CHATS[1]


def test_the_chat_template_renders_the_tool_role(tokenizer):
    text = tokenizer.apply_chat_template(TOOL_CHAT, tokenize=False)
    assert '<|user|><tool_response>{"sum": 5}</tool_response><|end|><|assistant|>5' in text


@pytest.mark.parametrize("source", ["jsonl", "datasets"])
def test_tool_turns_are_masked_by_default_and_trained_on_request(source, tokenizer, write_jsonl):
    path = write_chats(write_jsonl, [TOOL_CHAT])
    calls = ['{"name": "add", "arguments": [2, 3]}' + END_TOKEN, "5" + END_TOKEN]
    masked = load(path, tokenizer, source=source)[0]
    assert trained_text(tokenizer, masked) == calls
    out = tokenizer.apply_chat_template(
        TOOL_CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert (masked["labels"] != IGNORE_INDEX).long().tolist() == out["assistant_masks"]
    trained = load(path, tokenizer, source=source, train_tool_turns=True)[0]
    tool_turn = '<|user|><tool_response>{"sum": 5}</tool_response>' + END_TOKEN
    assert trained_text(tokenizer, trained) == [calls[0] + tool_turn, calls[1]]
    assert torch.equal(trained["input_ids"], masked["input_ids"])


def test_a_tool_message_must_follow_an_assistant_or_tool_message(tokenizer, write_jsonl):
    path = write_chats(write_jsonl, [[msg("user", "hi"), msg("tool", "x"), msg("assistant", "y")]])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: messages[1]: expected a 'tool'")):
        load(path, tokenizer)


# --- save_to_disk directories and datasets cached by name --------------------------------------


def test_save_to_disk_dirs_data_dirs_and_split_slices(tokenizer, tmp_path, write_jsonl):
    expected = load(write_chats(write_jsonl, ALPACA_CHATS), tokenizer)
    first_two = load(write_chats(write_jsonl, ALPACA_CHATS[:2], "two.jsonl"), tokenizer)
    datasets.Dataset.from_list(ALPACA).save_to_disk(tmp_path / "one")
    assert_same_examples(load(tmp_path / "one", tokenizer), expected)
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(SHAREGPT), test=datasets.Dataset.from_list(ALPACA)
    )
    splits.save_to_disk(tmp_path / "dict")
    assert_same_examples(load(tmp_path / "dict", tokenizer, split="test"), expected)
    assert_same_examples(load(tmp_path / "dict", tokenizer, split="test[:2]"), first_two)
    with pytest.raises(DataError, match=r"has no split 'dev' \(data.split\); expected one of"):
        load(tmp_path / "dict", tokenizer, split="dev")
    # a directory of data files, as a local copy of a Hub dataset repository holds them
    (tmp_path / "repo" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(ALPACA).to_parquet(tmp_path / "repo/data/train-00000.parquet")
    assert_same_examples(load(tmp_path / "repo", tokenizer), expected)
    assert_same_examples(load(tmp_path / "repo", tokenizer, split="train[:2]"), first_two)


def cache_by_name(name: str, rows: list[dict], tmp_path: Path) -> None:
    """Leave ``rows`` in the datasets cache the way ``load_dataset(name)`` of a Hub parquet
    dataset does (``<namespace>___<name>/default/<version>/<hash>/``), without a network."""
    namespace, dataset = name.split("/")
    file = tmp_path / f"{dataset}.parquet"
    datasets.Dataset.from_list(rows).to_parquet(file)

    class HubParquet(Parquet):
        BUILDER_CONFIGS = [
            ParquetConfig(
                name="default", data_files=DataFilesDict.from_patterns({"train": [str(file)]})
            )
        ]

    HubParquet(
        dataset_name=dataset, hash="0123456789abcdef", config_name="default"
    ).download_and_prepare()
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    (cache / dataset).rename(cache / f"{namespace}___{dataset}")


def test_dataset_cached_by_name_loads_offline(tokenizer, tmp_path, write_jsonl):
    cache_by_name("acme/tiny_alpaca", ALPACA, tmp_path)
    assert_same_examples(
        load("acme/tiny_alpaca", tokenizer), load(write_chats(write_jsonl, ALPACA_CHATS), tokenizer)
    )
    with pytest.raises(DataError, match="neither a local file or directory nor a dataset in"):
        load("acme/not_cached", tokenizer)


# --- the tokenization cache and num_proc -------------------------------------------------------

LOAD_IN_A_FRESH_PROCESS = """
import json, sys
from veoptim.data import load_tokenizer, load_sft_dataset
from veoptim.data.sources import ReadOptions
ds = load_sft_dataset(sys.argv[1], load_tokenizer(), int(sys.argv[2]), False, ReadOptions())
print(json.dumps({"files": ds.token_cache.files, "reused": ds.token_cache.reused,
                  "fingerprint": ds.fingerprint}))
"""


def load_in_subprocess(path: Path, max_len: int = MAX_LEN) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(path), str(max_len)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def snapshot(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def test_a_second_run_reuses_the_tokenized_cache(tokenizer, tmp_path, hf_cache):
    path = tmp_path / "alpaca.parquet"
    datasets.Dataset.from_list(ALPACA).to_parquet(path)
    first = load(path, tokenizer)
    assert not first.token_cache.reused
    tokens_dir = Path(first.token_cache.files[0]).parent
    assert tokens_dir.parent == hf_cache
    before = snapshot(tokens_dir)
    # a fresh process: nothing in memory, the cache key is recomputed from scratch
    second = load_in_subprocess(path)
    assert second["reused"] and tuple(second["files"]) == first.token_cache.files
    assert second["fingerprint"] == first.fingerprint
    assert snapshot(tokens_dir) == before  # no file written or rewritten: nothing tokenized


@pytest.mark.parametrize(
    "change",
    ["max_seq_len", "train_tool_turns", "chat_template", "edited_row"],
)
def test_a_change_that_alters_the_tokens_tokenizes_again(change, tokenizer, tmp_path):
    path = tmp_path / "sharegpt.parquet"
    datasets.Dataset.from_list(SHAREGPT).to_parquet(path)
    first = load(path, tokenizer)
    options, max_len, tok = {}, MAX_LEN, tokenizer
    if change == "max_seq_len":
        max_len = 40  # truncates the longest examples
    elif change == "train_tool_turns":
        options = {"train_tool_turns": True}
    elif change == "chat_template":
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = tokenizer.chat_template.replace("<|end|>", "<|end|>\n")
    else:
        edited = [*SHAREGPT[:3], {"conversations": [turn("human", "Say ok"), turn("gpt", "ok!")]}]
        datasets.Dataset.from_list(edited).to_parquet(path)
    again = load(path, tok, max_len, **options)
    assert not again.token_cache.reused
    assert set(again.token_cache.files).isdisjoint(first.token_cache.files)
    assert again.fingerprint != first.fingerprint  # a resumed data order notices the change


def test_num_proc_2_gives_identical_examples(tokenizer, tmp_path, write_jsonl):
    rows = SHAREGPT * 5
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "sharegpt.parquet")
    environ, before = os.environ, dict(os.environ)
    parallel = load(tmp_path / "sharegpt.parquet", tokenizer, packing=True, num_proc=2)
    # the workers' load leaves the process's environment as it was: the same mapping (so
    # the fixture's monkeypatch can undo its setenv there), the same contents
    assert os.environ is environ and dict(os.environ) == before
    assert len(parallel.token_cache.files) == 2  # one shard per worker
    reference = load(write_chats(write_jsonl, SHAREGPT_CHATS * 5), tokenizer, packing=True)
    assert_same_examples(parallel, reference)


# --- errors: one sentence naming the file and the row ------------------------------------------

BAD_ROWS = {
    "unknown_from": (
        {"conversations": [turn("human", "hi"), turn("bot", "yo")]},
        "row 2: 'conversations' entry 1 has from='bot'; expected one of ['system', 'human'",
    ),
    "value_not_a_string": (
        {"conversations": [turn("human", "hi"), {"from": "gpt", "value": None}]},
        "row 2: 'conversations' entry 1 has value of type NoneType; expected a string.",
    ),
    "ends_with_user": (
        {"conversations": [turn("human", "hi")]},
        "row 2: expected the conversation to end with an 'assistant' message",
    ),
    "empty_conversation": ({"conversations": []}, "row 2: expected 'conversations' to be a"),
}


@pytest.mark.parametrize("num_proc", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_names_the_file_and_row(case, num_proc, tokenizer, tmp_path):
    bad, expected = BAD_ROWS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([SHAREGPT[0], SHAREGPT[3], bad, SHAREGPT[0]]))
    with pytest.raises(DataError, match=re.escape(f"{path} {expected}")):
        load(path, tokenizer, num_proc=num_proc)


def test_a_bad_alpaca_row_names_the_column(tokenizer, tmp_path):
    rows = [ALPACA[0], {**ALPACA[1], "output": None}]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "a.parquet")
    message = (
        f"{tmp_path / 'a.parquet'} row 1: expected column 'output' to be a string, found NoneType."
    )
    with pytest.raises(DataError, match=re.escape(message)):
        load(tmp_path / "a.parquet", tokenizer)


def test_missing_columns_missing_files_and_unknown_settings(tokenizer, tmp_path, write_jsonl):
    path = tmp_path / "a.parquet"
    datasets.Dataset.from_list(ALPACA).to_parquet(path)
    with pytest.raises(
        DataError, match=r"data.layout=sharegpt expects the column\(s\) \['conversations'\], found"
    ):
        load(path, tokenizer, layout="sharegpt")
    with pytest.raises(DataError, match=r"expects the column\(s\) \['answer'\]"):
        load(path, tokenizer, layout="alpaca", columns={"output": "answer"})
    with pytest.raises(
        ConfigError, match="data.columns.conversations is not a column of data.layout=alpaca"
    ):
        load(path, tokenizer, layout="alpaca", columns={"conversations": "turns"})
    with pytest.raises(ConfigError, match="set data.layout to one of"):
        load(path, tokenizer, columns={"output": "answer"})
    with pytest.raises(ConfigError, match=r"data.layout must be one of \['auto', 'messages'"):
        load(path, tokenizer, layout="openai")
    with pytest.raises(ConfigError, match="data.source must be one of"):
        load(path, tokenizer, source="hub")
    with pytest.raises(DataError, match=r"data.layout=sharegpt expects the key\(s\)"):
        load(write_chats(write_jsonl, ALPACA_CHATS), tokenizer, source="jsonl", layout="sharegpt")
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=re.escape(f"SFT data file {missing} does not exist")):
        load(missing, tokenizer)
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported extension '.txt'"):
        load(tmp_path / "a.txt", tokenizer)
    datasets.Dataset.from_list([{"text": "hi"}]).to_parquet(tmp_path / "text.parquet")
    with pytest.raises(DataError, match=r"cannot tell the layout from the columns \['text'\]"):
        load(tmp_path / "text.parquet", tokenizer)
    with pytest.raises(DataError, match="data.split='test'"):
        load(path, tokenizer, split="test")


BAD_JSON = {
    # datasets wrapped these in "An error occurred while generating the dataset" and the
    # first line was all the error said
    "array.json": ('[{"prompt": "a", "response": "b"},\n {"prompt": "a" "response": "c"}]\n',
                   "expected a JSON array of objects or one JSON object per line, found invalid "
                   "JSON (Expecting ',' delimiter at column 17)."),
    "rows.jsonl": ('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": "c"} x\n',
                   "expected a JSON object per line, found invalid JSON (Extra data at column 34)."),
    "rows.json": ('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": \n',
                  "expected a JSON object per line, found invalid JSON (Expecting value at column 29)."),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BAD_JSON))
def test_invalid_json_through_datasets_names_the_line_and_the_whole_reason(
    name, tokenizer, tmp_path
):
    text, reason = BAD_JSON[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as info:
        load(path, tokenizer, source="datasets")
    message = str(info.value)
    assert message.endswith(f"with datasets: {path}:2: {reason}"), message
    assert "An error occurred while generating the dataset" not in message


# --- DPO preference pairs through datasets ------------------------------------------------------

PAIRS = [
    {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"},
    {"prompt": "Reverse emu", "chosen": "ume", "rejected": "emu"},
    {"prompt": "Uppercase dog", "chosen": "DOG", "rejected": "dog"},
]


def test_preference_pairs_parquet_equals_jsonl(tokenizer, tmp_path, write_jsonl):
    datasets.Dataset.from_list(PAIRS).to_parquet(tmp_path / "pairs.parquet")
    from_parquet = load_pair_dataset(str(tmp_path / "pairs.parquet"), tokenizer, MAX_LEN)
    from_jsonl = load_pair_dataset(str(write_jsonl(PAIRS, "pairs.jsonl")), tokenizer, MAX_LEN)
    assert len(from_parquet) == len(PAIRS) and from_parquet.fingerprint == from_jsonl.fingerprint
    bad = [*PAIRS, {"prompt": "Say hi", "chosen": "hi", "rejected": None}]
    datasets.Dataset.from_list(bad).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path / 'bad.parquet'} row 3: expected 'rejected'")
    ):
        load_pair_dataset(str(tmp_path / "bad.parquet"), tokenizer, MAX_LEN)
