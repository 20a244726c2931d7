"""Every mistyped override is one line and exit status 2, on the CLI and under torchrun.

Hydra alone printed 7-13 lines for ``optim.lrr=1e-3``, exited 1 and advised
``+optim.lrr=1e-3`` (which adds the typo); ``tasks/overrides.py`` composes the command
line first and names the key with the closest known one, the group's valid options, or
the expected type. These are real subprocesses of the commands; every error happens
before training.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.usage import render_help
from tests.conftest import REPO, run_sft_cli
from veoptim.objectives import SFTConfig

pytestmark = pytest.mark.slow

TYPOS = {
    "optim.lrr=1e-3": ["unknown config key optim.lrr", "did you mean optim.lr?"],
    "train.max_step=5": ["unknown config key train.max_step", "did you mean train.max_steps?"],
    "optim=adamww": [
        "unknown option 'adamww' of config group optim",
        "did you mean optim=adamw?",
        "valid options: adamw, cpu_offload_adamw, full_fp32_adamw, master_fp32_adamw",
    ],
    "train.max_steps=many": ["train.max_steps must be an int, not 'many'"],
    "+optim.lrr=1e-3": ["unknown config key optim.lrr", "did you mean optim.lr?"],
    "model=tiny_moee": ["config group model", "did you mean model=tiny_moe?"],
    # the section's own *_path keys, not model.path, which holds the same leaf name
    "data.path=rows.jsonl": [
        "unknown config key data.path",
        "did you mean one of data.tokenizer_path, data.eval_path, data.train_path?",
    ],
}


def _one_error_line(proc: subprocess.CompletedProcess, expected: list[str]) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    assert "To append to your config use +" not in lines[0]  # Hydra's advice to add the typo
    assert not proc.stdout


@pytest.mark.parametrize("typo", list(TYPOS))
def test_a_typo_is_one_line_naming_the_key_and_the_suggestion_exit_2(typo, tmp_path):
    proc = run_sft_cli([typo, f"run.dir={tmp_path / 'run'}"], tmp_path, fresh=True)
    _one_error_line(proc, TYPOS[typo])
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run dir


def test_a_typo_in_one_sweep_value_is_one_line(tmp_path):
    proc = run_sft_cli(
        ["-m", "optim.lr=1e-3,x", f"run.dir={tmp_path / 'run'}"], tmp_path, fresh=True
    )
    _one_error_line(proc, ["optim.lr must be a float, not 'x'"])
    assert not (tmp_path / "run").exists()


def test_a_valid_override_still_runs(tmp_path, tiny_overrides):
    proc = run_sft_cli([*tiny_overrides, "train.max_steps=2", "optim.lr=1e-3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error:" not in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_torchrun_prints_each_ranks_one_line_then_its_own_summary(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = Path(shutil.which("torchrun") or "torchrun")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tasks.sft",
         "optim.lrr=1", f"run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    ours = [line for line in lines if line.startswith("[rank")]
    # torchrun's own lines: its agent's log lines (W.../E...), its launcher's traceback of
    # ChildFailedError and the failure summary; nothing else comes from the ranks.
    summary_start = next(i for i, line in enumerate(lines) if not line.startswith("[rank"))
    assert ours and lines[:summary_start] == ours, proc.stderr[-3000:]
    assert all("[rank" not in line for line in lines[summary_start:]), proc.stderr[-3000:]
    ranks = [line.split("]")[0] for line in ours]
    assert len(set(ranks)) == len(ranks) <= 2  # one line per rank (torchrun may stop one first)
    for line in ours:
        assert "error: unknown config key optim.lrr" in line and "did you mean optim.lr?" in line
    assert "exitcode  : 2" in proc.stderr
    assert "Set the environment variable HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_help_promises_one_line_and_exit_2():
    text = " ".join(render_help("sft", SFTConfig, "veoptim-sft", "sft").split())
    assert "one line naming the key and the closest known key" in text
    assert "exit status 2; under torchrun every rank prints that line" in text


#: Another tool's key or flag, and what the one line names (veoptim's setting for it).
HABITS = {
    ("load_in_4bit=true",): ["unknown config key load_in_4bit", "did you mean model.quant=nf4"],
    ("--quantization", "nf4"): ["--quantization is not an option", "did you mean model.quant=nf4"],
    ("--load-in-4bit",): ["--load-in-4bit is not an option", "did you mean model.quant=nf4"],
    ("--fp16",): ["--fp16 is not an option", "did you mean model.dtype=fp16"],
    ("+fp16=true",): ["unknown config key fp16", "did you mean model.dtype=fp16"],
    ("data.template=chatml",): ["unknown config key data.template", "data.chat_template="],
}


@pytest.mark.parametrize("habit", list(HABITS), ids=" ".join)
def test_another_tools_habit_is_one_line_naming_veoptims_key_exit_2(habit, tmp_path):
    proc = run_sft_cli([*habit, f"run.dir={tmp_path / 'run'}"], tmp_path, fresh=True)
    _one_error_line(proc, HABITS[habit])
    assert not (tmp_path / "run").exists()
