"""Every command of README.md and docs/getting_started.md, in the order written, on a fresh clone.

A newcomer copies the fenced ``bash`` blocks one after the other into a fresh checkout:
README first, then the getting-started guide. This test does the same: ``git clone`` of
this repository (its committed ``HEAD``, or ``VEOPTIM_WALKTHROUGH_REF``) into a temporary
directory, this test's virtual environment linked in as the clone's ``.venv`` (what
``make setup`` would create), and each command run with ``bash`` in the clone, asserting
exit status 0. The only changes: training commands that set no ``train.max_steps`` (nor
``train.epochs``) get a short one appended, and ``make X`` runs as
``make -o .venv/.installed X`` (the target's own commands, without setting up the linked
venv again). A command written twice (``make demo`` opens both docs) runs once. Commands
that cannot run here are in ``NOT_RUN`` with the reason, and each of them must still be in
the docs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/getting_started.md")
REF = os.environ.get("VEOPTIM_WALKTHROUGH_REF", "HEAD")

#: Commands not run (as written, continuation lines joined, the comment dropped): why.
NOT_RUN = {
    "make test": "the whole suite, which includes this test",
    "git clone <this repo> veoptim && cd veoptim": "the test's own git clone",
    ".venv/bin/torchrun --nnodes 2 --nproc_per_node 8 --node_rank $NODE_RANK "
    "--rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 --rdzv_id sft -m tasks.sft "
    "--config-name recipes/cuda_sft_16rank model.path=/models/Qwen3-30B-A3B": (
        "16 CUDA GPUs on two nodes and a 30B model"
    ),
    ".venv/bin/python -m tasks.serve lora.num_slots=8 lora.r=32": (
        "a server that runs until stopped (tests/service drives it)"
    ),
    "python3 -m venv ~/venvs/veoptim": "installing the package: scripts/check_install.sh",
    "~/venvs/veoptim/bin/pip install '/path/to/veoptim[plots]'": "scripts/check_install.sh",
    "cd /anywhere": "scripts/check_install.sh",
    "~/venvs/veoptim/bin/veoptim-sft --help": "scripts/check_install.sh",
    "~/venvs/veoptim/bin/veoptim-sft train.max_steps=100 run.dir=runs/first": (
        "scripts/check_install.sh"
    ),
    "~/venvs/veoptim/bin/veoptim-dpo model.path=runs/first/exports/hf_final "
    "run.dir=runs/first_dpo": "scripts/check_install.sh",
    "~/venvs/veoptim/bin/veoptim-multi-lora run.dir=runs/slots": "scripts/check_install.sh",
    "~/venvs/veoptim/bin/veoptim-sweep-report runs/first": "scripts/check_install.sh",
    "~/venvs/veoptim/bin/veoptim-export runs/first/checkpoints/step_00000100 "
    "--out runs/first/exports --name hf_100": "scripts/check_install.sh",
    "python3 -m venv ~/venvs/veoptim && ~/venvs/veoptim/bin/pip install "
    "'/path/to/veoptim[plots]'": "scripts/check_install.sh",
    "cd /anywhere && ~/venvs/veoptim/bin/veoptim-sft train.max_steps=100 run.dir=runs/first": (
        "scripts/check_install.sh"
    ),
    ".venv/bin/python -m tasks.sft data.train_path=/data/chat.jsonl data.max_seq_len=1024 "
    "data.packing=true model=hf_local model.path=/models/Qwen2-0.5B-Instruct": (
        "your own data and model (placeholders)"
    ),
    ".venv/bin/python -m tasks.sft model=hf_local model.path=/models/my-llama "
    "data.train_path=/data/chat.jsonl data.max_seq_len=2048 model.attn_implementation=sdpa "
    "model.activation_checkpointing=true": "your own data and model (placeholders)",
    ".venv/bin/python -m tasks.sft data.eval_path=/data/chat_eval.jsonl train.eval_every=100": (
        "your own eval data (placeholder)"
    ),
}
#: Appended to a training command that sets no length of its own; a resumed pair
#: (``train.stop_at_step=150``, then ``checkpoint.resume=auto``) needs more than its slice.
SHORT = "train.max_steps=50"
SHORT_RESUMED = "train.max_steps=200"
TRAINING = re.compile(r"(-m tasks\.(sft|dpo|multi_lora)|veoptim-(sft|dpo|multi-lora))(\s|$)")
LENGTH_SET = ("train.max_steps=", "train.epochs=", "run.dry_run=true", "--help")
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(text: str) -> list[str]:
    """The commands of every fenced ``bash`` block, continuation lines joined, in order."""
    found = []
    for block in BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            command = " ".join(strip_comment(line).split())
            if command:
                found.append(command)
    return found


def as_run(command: str) -> str:
    """What the test runs for ``command`` (see the module docstring)."""
    if command.startswith("make "):
        return f"make -o .venv/.installed {command[len('make ') :]}"
    if TRAINING.search(command) and not any(key in command for key in LENGTH_SET):
        resumed = "train.stop_at_step=" in command or "checkpoint.resume=" in command
        return f"{command} {SHORT_RESUMED if resumed else SHORT}"
    return command


def test_the_walkthrough_extracts_commands_and_every_skip_is_in_the_docs():
    """Fast guard: blocks are found, and ``NOT_RUN`` names only commands the docs contain."""
    found = [c for doc in DOCS for c in commands((REPO / doc).read_text())]
    assert "make demo" in found and len(found) > 20
    assert sorted(set(NOT_RUN) - set(found)) == []
    assert as_run("make demo") == "make -o .venv/.installed demo"
    assert as_run("x -m tasks.sft a=1") == f"x -m tasks.sft a=1 {SHORT}"
    assert as_run("x -m tasks.sft train.epochs=3") == "x -m tasks.sft train.epochs=3"
    assert strip_comment("a 'b # c' # d") == "a 'b # c'"


@pytest.mark.slow
def test_every_readme_and_getting_started_command_runs_in_order_on_a_fresh_clone(tmp_path):
    venv = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or not (venv / "bin" / "torchrun").exists():
        pytest.skip("needs the checkout's virtual environment (make setup)")
    clone = tmp_path / "veoptim"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", REF], check=True)
    (clone / ".venv").symlink_to(venv, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1"
    )
    failures, ran, started = [], [], time.monotonic()
    for doc in DOCS:
        for command in commands((clone / doc).read_text()):
            run = as_run(command)
            if command in NOT_RUN or run in {r.split(": ", 1)[1] for r in ran}:
                continue
            proc = subprocess.run(
                ["bash", "-c", run],
                cwd=clone,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            ran.append(f"{time.monotonic() - started:6.1f}s {doc}: {run}")
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                failures.append(f"{doc}: {run}\n  exit {proc.returncode}: " + "\n  ".join(tail))
    print("\n".join(ran))
    assert not failures, "\n".join(failures)
