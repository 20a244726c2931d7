"""Make the base model the RL tests serve: the bundled tiny model (``tiny_dense``), trained
from its seeded initialisation with ``tasks.sft`` to answer the cookbook's arithmetic
problems right only sometimes.

    .venv/bin/python -m scripts.arithmetic_base --out tests/fixtures/arithmetic_base

writes ``tests/fixtures/arithmetic_base`` (a Hugging Face export, BF16, ~300 kB) exactly as
committed: the data, the SFT run (one thread, fixed seeds) and the export are
deterministic; ``--check DIR`` makes it again in a temporary directory and compares every
file with ``DIR`` byte for byte (exit 1 on a difference). About 10 minutes on one CPU core.

What the model learns. ``tinker_cookbook.recipes.math_rl``'s arithmetic environment asks
``What is x + y?`` (``x``, ``y`` in 0..100) behind a one-shot prefix, in the ``role_colon``
format, and rewards a sample whose final integer is ``x + y`` (1) and which ends with the
stop sequence ``\\n\\nUser:`` (else -0.1). Each line of the SFT data is that conversation:

    User: What is 4 + 5?\\n\\nAssistant: 9\\n\\nUser: What is 49 + 97?\\n\\nAssistant: 146\\n\\nUser:

rendered by a chat template that writes exactly what the cookbook's ``role_colon`` renderer
writes, the answer followed by ``User:`` (the rest of the stop sequence), so the trained
tokens are the sample the environment wants; the script checks, line by line, that the
tokens equal the renderer's prompt plus the answer's tokens. In :data:`RIGHT_SHARE` of the
lines the answer is ``x + y``; in the others it is ``x`` or ``y`` (half each): the base
learns to add and to echo an operand, and, sampled at temperature 1 as the recipe samples,
adds in about that share of its answers. RL has something to find: the answers that add
are rewarded, those that echo are not, and turning the echo down is a change that holds
for every problem. (A base trained on answers off by a small amount instead, ``x + y + 1``
and the like, learned more slowly under RL: its right and wrong answers differ only in a
digit, problem by problem.)
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "veoptim" / "assets" / "tokenizer"
SEED = 0
NUM_LINES = 40_000
#: The share of lines whose answer is the sum; the others echo x or y.
RIGHT_SHARE = 0.4
FEW_SHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
SFT_OVERRIDES = [
    "model=tiny_dense", "data.max_seq_len=64", "train.global_batch_size=64",
    "train.micro_batch_size=64", "train.max_steps=8000", "optim.lr=3e-3", "train.seed=0",
    "logging.progress=false", "checkpoint.save_at_end=false", "export.dtype=bf16",
]  # fmt: skip
#: Starts of tasks.sft: a run stopped by SIGTERM (it saves first) is resumed.
ATTEMPTS = 5
#: The export's files that make the fixture (its manifest records a time: left out).
KEEP = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja", "veoptim_model.json")  # fmt: skip

#: ``role_colon``: ``Role: content\\n\\n`` per message, an assistant turn followed by
#: ``User:`` (the stop sequence's end; the next user turn then starts with its content).
TEMPLATE = """\
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'assistant' -%}User:{%- endif -%}
{{ ' ' + message['content'] + '\\n\\n' }}
{%- elif message['role'] == 'assistant' -%}
Assistant:{% generation %}{{ ' ' + message['content'] + '\\n\\nUser:' }}{% endgeneration %}
{%- else -%}
{{ raise_exception('role_colon renders user and assistant turns only') }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}Assistant:{%- endif -%}
"""


def conversations(seed: int = SEED, count: int = NUM_LINES) -> list[list[dict[str, str]]]:
    """The SFT data: one-shot prefix, ``What is x + y?``, and the sum or an operand."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        x, y = rng.randint(0, 100), rng.randint(0, 100)
        u = rng.random()
        answer = x + y if u < RIGHT_SHARE else (x if u < (1 + RIGHT_SHARE) / 2 else y)
        question = {"role": "user", "content": f"What is {x} + {y}?"}
        lines.append([*FEW_SHOT, question, {"role": "assistant", "content": str(answer)}])
    return lines


def check_rendering(lines: list[list[dict[str, str]]], template: str) -> None:
    """Every line's tokens under ``template`` are the cookbook renderer's prompt, then the
    answer and the stop sequence as the renderer encodes them."""
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    renderer = renderers.get_renderer("role_colon", tokenizer=tokenizer)
    tokenizer.chat_template = template
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for i, messages in enumerate(lines):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = renderer.build_generation_prompt(messages[:-1]).to_ints()
        expected = prompt + encode(f" {messages[-1]['content']}\n\n") + encode("User:")
        if encode(text) != expected:
            raise SystemExit(f"line {i}: the template's tokens differ from role_colon's: {text!r}")


def make(out: Path, work: Path) -> None:
    """Write the data, train, and copy the export's files to ``out``."""
    lines = conversations()
    check_rendering(lines, TEMPLATE)
    data, template = work / "arithmetic.jsonl", work / "role_colon.jinja"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    template.write_text(TEMPLATE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "tasks.sft", f"run.dir={work / 'run'}",
               f"data.train_path={data}", f"data.chat_template={template}", *SFT_OVERRIDES]  # fmt: skip
    for attempt in range(ATTEMPTS):
        resume = ["checkpoint.resume=auto"] if attempt else []
        print(" ".join([*command[1:], *resume]), flush=True)
        if subprocess.run([*command, *resume], cwd=REPO, env=env).returncode == 0:
            break
        # a SIGTERM saves a checkpoint first; the resumed run continues it bit for bit
        if not any((work / "run" / "checkpoints").glob("step_*")):
            raise SystemExit("tasks.sft failed before its first checkpoint (see above)")
    else:
        raise SystemExit(f"tasks.sft did not finish in {ATTEMPTS} attempts (see above)")
    export = work / "run" / "exports" / "hf_final"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in KEEP:
        shutil.copyfile(export / name, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the base here (replacing the directory)")
    group.add_argument("--check", type=Path, help="make it again and compare with this one")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="arithmetic_base_") as tmp:
        work = Path(tmp)
        if args.out:
            make(args.out, work)
            print(f"wrote {args.out}")
            return 0
        make(work / "base", work)
        match, mismatch, errors = filecmp.cmpfiles(args.check, work / "base", KEEP, shallow=False)
        if mismatch or errors:
            print(f"differs from {args.check}: {mismatch + errors}")
            return 1
        print(f"{args.check} is reproduced byte for byte ({len(match)} files)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
