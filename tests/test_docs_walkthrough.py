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

A command that is one ``.venv/bin/python -m MODULE ARGS`` with nothing else for the shell to
do runs as ``bash`` would start it, but forked from the test process's preloaded server
(``tests/forkserver.py``) with the words ``bash`` expands it to. The server has imported
this checkout's library, so this is done only when the checkout's files are the clone's
(``HEAD`` cloned, nothing uncommitted); otherwise every command runs with ``bash``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

pytestmark = pytest.mark.slow

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
#: Outside quotes, what makes a command more than one simple command: operators,
#: redirections, subshells. (``$`` and backticks anywhere: substitutions.)
OPERATORS = re.compile(r"[|&;<>()]")
SUBSTITUTIONS = ("$", "`")
PYTHON_M = [".venv/bin/python", "-m"]


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


def python_module(run: str, cwd: Path) -> tuple[str, list[str]] | None:
    """``(module, args)`` if ``run`` is one simple ``.venv/bin/python -m MODULE ARGS``
    command, its words as ``bash`` expands them in ``cwd`` (quotes, globs); else None."""
    if any(s in run for s in SUBSTITUTIONS):
        return None
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    if any(OPERATORS.fullmatch(token[0]) for token in lexer if token):
        return None
    words = subprocess.run(
        ["bash", "-c", f"set -- {run}; printf '%s\\0' \"$@\""],
        cwd=cwd, capture_output=True, text=True, check=True,
    ).stdout.split("\0")[:-1]  # fmt: skip
    if words[:2] != PYTHON_M or len(words) < 3:
        return None
    return words[2], words[3:]


def checkout_is_the_clone() -> bool:
    """Whether this checkout's files are those of the clone the test makes."""
    if REF != "HEAD":
        return False
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return status.stdout == ""


def run_command(run: str, cwd: Path, env: dict[str, str], fork: bool) -> tuple[int, str]:
    """Run ``run`` as ``bash -c`` would (forked where ``fork`` and :func:`python_module`
    allow); its exit status and its output."""
    module = python_module(run, cwd) if fork else None
    if module is not None:
        proc = forkserver.run_module(*module, cwd=cwd, env=env, timeout=600)
    else:
        proc = subprocess.run(["bash", "-c", run], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def test_the_walkthrough_extracts_commands_and_every_skip_is_in_the_docs():
    """Fast guard: blocks are found, and ``NOT_RUN`` names only commands the docs contain."""
    found = [c for doc in DOCS for c in commands((REPO / doc).read_text())]
    assert "make demo" in found and len(found) > 20
    assert sorted(set(NOT_RUN) - set(found)) == []
    assert as_run("make demo") == "make -o .venv/.installed demo"
    assert as_run("x -m tasks.sft a=1") == f"x -m tasks.sft a=1 {SHORT}"
    assert as_run("x -m tasks.sft train.epochs=3") == "x -m tasks.sft train.epochs=3"
    assert strip_comment("a 'b # c' # d") == "a 'b # c'"


def test_only_one_simple_python_module_command_is_forked(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.txt").write_text("")
    module = python_module
    assert module(".venv/bin/python -m tasks.generate x --prompt \"What is 12+30?\"",
                  tmp_path) == ("tasks.generate", ["x", "--prompt", "What is 12+30?"])  # fmt: skip
    assert module(".venv/bin/python -m m 'a=[mlp]' runs/*.txt", tmp_path) == (
        "m",
        ["a=[mlp]", "runs/a.txt"],
    )
    for not_simple in (
        ".venv/bin/python -m m a; rm -rf runs",
        ".venv/bin/python -m m a && echo done",
        ".venv/bin/python -m m a | tee log",
        ".venv/bin/python -m m a > log",
        ".venv/bin/python -m m $HOME",
        "X=1 .venv/bin/python -m m",
        ".venv/bin/python scripts/sweep_report.py runs",
        ".venv/bin/torchrun -m tasks.sft",
        "make demo",
    ):
        assert module(not_simple, tmp_path) is None, not_simple
    assert (tmp_path / "runs").is_dir()


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
    fork = checkout_is_the_clone()
    failures, ran, started = [], [], time.monotonic()
    for doc in DOCS:
        for command in commands((clone / doc).read_text()):
            run = as_run(command)
            if command in NOT_RUN or run in {r.split(": ", 1)[1] for r in ran}:
                continue
            status, output = run_command(run, clone, env, fork)
            ran.append(f"{time.monotonic() - started:6.1f}s {doc}: {run}")
            if status != 0:
                tail = output.strip().splitlines()[-3:]
                failures.append(f"{doc}: {run}\n  exit {status}: " + "\n  ".join(tail))
    print("\n".join(ran))
    assert not failures, "\n".join(failures)
