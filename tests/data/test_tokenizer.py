"""The bundled tokenizer: loadable by AutoTokenizer offline, byte-level round trip, chat template."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts import make_assets
from veoptim.data import bundled_dataset_path, bundled_tokenizer_dir, load_tokenizer
from veoptim.data.chat_format import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS
from veoptim.data.paths import ASSETS_DIR
from veoptim.errors import DataError


def test_bundled_tokenizer_loads_with_autotokenizer_as_fast_tokenizer():
    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir(), local_files_only=True)
    assert tok.is_fast
    assert len(tok) == make_assets.VOCAB_SIZE
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 0
    assert tok.eos_token == EOS_TOKEN
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)


def test_special_tokens_are_single_ids(tokenizer):
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids(token)
        ]


@pytest.mark.parametrize(
    "text",
    [
        "What is 37+58?",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew\r\nlines\n\n",
        string.printable,
        "",
    ],
)
def test_decode_encode_round_trips_ascii(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_decode_encode_round_trips_random_ascii(tokenizer):
    rng = random.Random(0)
    alphabet = "".join(chr(c) for c in range(128))
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_encoding_adds_no_bos_or_eos(tokenizer):
    assert tokenizer("abc")["input_ids"] == tokenizer.encode("abc", add_special_tokens=False)


def test_chat_template_renders_the_bundled_format(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|system|>Be brief.<|end|><|user|>What is 2+3?<|end|><|assistant|>5<|end|>"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>")


def test_load_tokenizer_missing_dir_raises_data_error(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_tokenizer_dir_without_tokenizer_files_raises_data_error(tmp_path: Path):
    with pytest.raises(DataError, match="neither tokenizer.json nor tokenizer_config.json"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_corrupt_tokenizer_json_raises_data_error(tmp_path: Path):
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (tmp_path / name).write_text((bundled_tokenizer_dir() / name).read_text()[:100])
    with pytest.raises(DataError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


def test_bundled_assets_are_reproducible_from_the_script(tmp_path: Path):
    make_assets.generate(tmp_path)
    assert make_assets.same_tree(tmp_path, ASSETS_DIR)


def test_bundled_assets_are_small_and_examples_short(tokenizer):
    total = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file())
    assert total < 1_000_000
    lines = bundled_dataset_path().read_text().splitlines()
    assert 2000 <= len(lines) <= 4000
