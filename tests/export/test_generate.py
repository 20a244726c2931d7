"""``veoptim-generate``: greedy replies equal ``transformers`` ``generate`` token for token, on
an HF export, a merged export and a base plus its PEFT adapter; sampling is seeded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from callbacks import standard_callbacks
from tasks.export import main as export_main
from tasks.generate import main
from tests import forkserver
from tests.checkpoint.ckpt_state import build_trainer
from tests.conftest import REPO
from veoptim.export.adapters import BASE_EXPORT

pytestmark = pytest.mark.slow

PROMPTS = ["What is 12+30?", 'Repeat "melon crab"', "Reverse: cat dog"]
NEW_TOKENS = 12
LORA = ["lora.enabled=true", "lora.r=4", "model.dtype=fp32", "export.hf=true", "export.dtype=fp32",
        "train.max_steps=6", "optim.lr=0.03", "scheduler.warmup_steps=1"]  # fmt: skip


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A short LoRA SFT run: its adapter (lora_final), its base (hf_base) and a merged export."""
    run_dir = tmp_path_factory.mktemp("generate_run")
    trainer = build_trainer(run_dir, LORA)
    trainer.callbacks.callbacks = standard_callbacks(trainer.cfg, {})
    trainer.train()
    out = run_dir / "exports"
    checkpoint = run_dir / "checkpoints" / "step_00000006"
    argv = [str(checkpoint), "--out", str(out), "--name", "merged", "--format", "merged",
            "--dtype", "fp32", "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    return {"hf": out / BASE_EXPORT, "merged": out / "merged", "adapter": out / "lora_final"}


def reference(model, tokenizer, prompt: str) -> list[int]:
    """Plain transformers: the chat template, then greedy ``generate``."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )  # fmt: skip
    with torch.no_grad():
        out = model.generate(
            **ids, max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return out[0, ids["input_ids"].shape[1] :].tolist()


def generated(capsys, *argv: str) -> list[dict]:
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    assert main([*argv, *args, "--max-new-tokens", str(NEW_TOKENS), "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    return rows


@pytest.mark.parametrize("kind", ["hf", "merged"])
def test_greedy_output_equals_transformers_generate(exports, capsys, kind):
    path = exports[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = generated(capsys, str(path))
    for row, prompt in zip(rows, PROMPTS, strict=True):
        expected = reference(model, tokenizer, prompt)
        assert expected and row["token_ids"] == expected
        assert row["completion"] == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_an_adapter_dir_alone_or_with_its_base_equals_peft_generate(exports, capsys):
    base_dir, adapter = exports["hf"], exports["adapter"]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)  # the adapter dir has none
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    plain = [reference(base, tokenizer, p) for p in PROMPTS]
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    expected = [reference(peft_model, tokenizer, p) for p in PROMPTS]
    assert expected != plain  # the adapter changes the replies: it is applied
    alone = generated(capsys, str(adapter))  # the base from adapter_config.json
    with_base = generated(capsys, str(base_dir), "--adapter", str(adapter))
    assert [r["token_ids"] for r in alone] == expected
    assert [r["token_ids"] for r in with_base] == expected


def test_sampling_is_seeded_and_prompts_come_from_jsonl(exports, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": PROMPTS[0]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": PROMPTS[1]},
                                   {"role": "assistant", "content": "dropped"}]}) + "\n"
    )  # fmt: skip
    sample = [str(exports["merged"]), "--prompts", str(prompts), "--temperature", "1.5",
              "--top-p", "0.95", "--max-new-tokens", "16"]  # fmt: skip
    runs = []
    for seed in ("1", "1", "2"):
        assert main([*sample, "--seed", seed, "--format", "jsonl"]) == 0
        runs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0][1]["prompt"] == [{"role": "user", "content": PROMPTS[1]}]
    assert main([*sample, "--seed", "1"]) == 0  # text: one reply per prompt
    assert capsys.readouterr().out.splitlines() == [r["completion"] for r in runs[0]]


def test_the_command_runs_and_a_wrong_dir_is_one_line_exit_2(exports, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tasks.generate"]
    ok = forkserver.run_module("tasks.generate", [str(exports["hf"]), "--prompt", PROMPTS[0],
                               "--max-new-tokens", "4", "--format", "jsonl"],
                               cwd=REPO, env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["prompt"] == PROMPTS[0]
    bad = subprocess.run([*command, str(tmp_path), "--prompt", "hi"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    assert "neither a Hugging Face model directory" in bad.stderr


def test_generate_and_export_draw_no_loading_bars(exports, tmp_path):
    """transformers draws a "Loading weights" bar for every model it loads (the base of a
    merged export, the model and the base of an adapter): neither command shows one, and
    the commands' own output is all there is."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    checkpoint = exports["adapter"].parent.parent / "checkpoints" / "step_00000006"
    export = forkserver.run_module("tasks.export", [str(checkpoint), "--out", str(tmp_path),
                                   "--name", "merged", "--format", "merged", "--no-fsync"],
                                   cwd=REPO, env=env)  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    assert export.stderr == "" and export.stdout.startswith("wrote "), export.stdout + export.stderr
    for model in (exports["adapter"], tmp_path / "merged"):
        generate = forkserver.run_module("tasks.generate", [str(model), "--prompt", PROMPTS[0],
                                         "--max-new-tokens", "4"], cwd=REPO, env=env)  # fmt: skip
        assert generate.returncode == 0, generate.stderr[-2000:]
        assert "Loading weights" not in generate.stderr and "\r" not in generate.stderr, (
            generate.stderr
        )
