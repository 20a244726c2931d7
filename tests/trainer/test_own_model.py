"""Bring your own model: a tiny Llama with its own tokenizer and chat template, fine-tuned
through the real CLI (``model=hf_local model.path=<dir>``) with activation checkpointing,
exported, and reloaded with plain transformers.

Nothing here is Qwen or the bundled tokenizer: another architecture, another vocabulary
(a byte-level BPE trained on a few strings), another chat template (Llama 3 style
headers), own data. The export must reproduce, bit for bit, the logits of the weights
the run's final checkpoint holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tests.conftest import run_sft_cli
from veoptim.export.source import model_inventory, open_checkpoint, read_model_tensors

pytestmark = pytest.mark.slow

BOS, EOT, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>"
HEADERS = ("<|start_header_id|>", "<|end_header_id|>")
#: Llama 3 style turns; ``{% generation %}`` marks the trained span of assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] }}<|eot_id|>{% endgeneration %}"
    "{%- else -%}{{ message['content'] }}<|eot_id|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif -%}"
)
WORDS = "red green blue cyan amber violet".split()
STEPS = 6
PROMPT = [{"role": "user", "content": "colour after red?"}]


def chats() -> list[list[dict[str, str]]]:
    return [
        [
            {"role": "user", "content": f"colour after {a}?"},
            {"role": "assistant", "content": b},
        ]
        for a, b in zip(WORDS, WORDS[1:] + WORDS[:1], strict=True)
    ]


def write_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the data's strings, with its own special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[PAD, BOS, EOT, *HEADERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["content"] for chat in chats() for m in chat] + ["user assistant system"]
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        extra_special_tokens=list(HEADERS),
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def write_llama(out: Path) -> None:
    """A 2-layer Llama (hidden 64) and its tokenizer in one directory, as from the Hub."""
    tokenizer = write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a few SFT steps of the Llama, activation checkpointing on."""
    root = tmp_path_factory.mktemp("own_model")
    write_llama(root / "llama")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats()))
    run_dir = root / "run"
    proc = run_sft_cli(
        [
            "model=hf_local",
            f"model.path={root / 'llama'}",
            "model.activation_checkpointing=true",
            f"data.train_path={data}",
            "data.max_seq_len=64",
            f"run.dir={run_dir}",
            "run.device=cpu",
            f"train.max_steps={STEPS}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "optim.lr=1e-2",
            "scheduler.warmup_steps=1",
            "logging.progress=false",
            "export.dtype=fp32",  # the trained weights' dtype: the logits compare exactly
        ],
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def logits(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_run_trains_the_llama(finetuned: Path) -> None:
    records = [json.loads(line) for line in (finetuned / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"], records
    resolved = (finetuned / "config.yaml").read_text()
    assert "activation_checkpointing: true" in resolved


def test_export_reloads_with_the_trained_weights(finetuned: Path) -> None:
    """transformers loads the export (a Llama, its tokenizer and template) and its logits
    equal those of the final checkpoint's weights; training changed them."""
    export = finetuned / "exports" / "hf_final"
    exported = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert isinstance(exported, LlamaForCausalLM)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert "gradient_checkpointing" not in (export / "config.json").read_text()

    source = open_checkpoint(finetuned / "checkpoints" / f"step_{STEPS:08d}")
    trained = read_model_tensors(source, model_inventory(source))
    original = source.cfg.model.path
    model = AutoModelForCausalLM.from_pretrained(original)
    before = logits(model, tokenizer)
    assert sorted(trained) == sorted(model.state_dict())  # checkpointing renamed nothing
    model.load_state_dict(trained)
    assert torch.equal(logits(exported, tokenizer), logits(model, tokenizer))
    assert not torch.equal(before, logits(model, tokenizer))


# Evaluation of the fine-tuned model belongs here, on the same `finetuned` run directory
# (one more test using the fixture, so the run is not repeated): the eval work adds it.
