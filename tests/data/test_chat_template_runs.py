"""A run with ``data.chat_template`` exports the template with its tokenizer: plain
``transformers`` and ``veoptim-generate`` render prompts with it (full and LoRA runs);
an unknown name on the command line is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.conftest import run_sft_cli
from tests.data.test_chat_templates import CHAT, FAMILY_TOKENS, RENDERED
from veoptim.data import bundled_tokenizer_dir
from veoptim.export.generate import encode, load_model

pytestmark = pytest.mark.slow

RUN = ["run.device=cpu", "train.max_steps=2", "train.global_batch_size=4",
       "train.micro_batch_size=4", "scheduler.warmup_steps=1", "logging.progress=false",
       "checkpoint.fsync=false", "data.chat_template=chatml"]  # fmt: skip


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory) -> Path:
    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir(), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS})
    out = tmp_path_factory.mktemp("family_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_exported_tokenizer_carries_the_template_for_transformers_and_generate(
    tmp_path, family_dir, lora
):
    run = tmp_path / "run"
    extra = ["lora.enabled=true"] if lora else []
    done = run_sft_cli([*RUN, f"run.dir={run}", f"data.tokenizer_path={family_dir}", *extra],
                       tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    export = run / "exports" / ("lora_final" if lora else "hf_final")
    plain = AutoTokenizer.from_pretrained(export)  # what a transformers user loads
    assert plain.apply_chat_template(CHAT, tokenize=False) == RENDERED["chatml"]
    assert plain.eos_token == "<|im_end|>"
    _, tokenizer = load_model(export)  # veoptim-generate's loader (an adapter dir alone too)
    prompt = encode(tokenizer, CHAT[:1])[0].tolist()
    expected = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == plain(expected, add_special_tokens=False)["input_ids"]


def test_an_unknown_template_name_is_one_line_and_exit_2(tmp_path):
    done = run_sft_cli([*RUN[:-1], "data.chat_template=alpaca", f"run.dir={tmp_path / 'r'}"],
                       tmp_path, fresh=True)  # fmt: skip
    assert done.returncode == 2
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if "ConfigError" in line]
    assert len(errors) == 1, output[-2000:]
    assert (
        "data.chat_template='alpaca' is not a known template; known: chatml, llama3, qwen2"
        in errors[0]
    )
