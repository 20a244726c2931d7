"""``run.dry_run=true``: the startup's checks and the run's plan, without training or saving."""

from __future__ import annotations

import re

import pytest

from tasks.usage import render_help
from tests.conftest import run_sft_cli
from veoptim.objectives import SFTConfig

pytestmark = pytest.mark.slow


def test_dry_run_prints_the_plan_and_writes_no_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_sft_cli(
        [f"run.dir={run}", "run.dry_run=true", "train.max_steps=7", "train.global_batch_size=8",
         "train.micro_batch_size=2", "data.eval_fraction=0.1"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("dry run: the config is valid")
    )
    plan = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[start + 1 :])
    assert plan["model"] == "tiny_dense (qwen2)"
    assert plan["parameters"] == "139,840 (139,840 trainable)"
    assert plan["train data"] == "the bundled synthetic data: 2,700 training examples, 300 eval"
    assert plan["steps"] == "7 (337 per epoch)"  # 2,700 training examples // 8
    assert plan["batch"] == "global 8 sequences, micro 2 per forward, 4 accumulation steps per rank"
    assert plan["world size"] == "1"
    assert plan["checkpoints"] == f"{run / 'checkpoints'} (empty: a fresh run)"
    assert plan["run dir"] == str(run)
    assert not (run / "checkpoints").exists() and not (run / "exports").exists()
    assert not (run / "metrics.jsonl").exists()


def test_dry_run_with_a_bad_data_path_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "no_such.jsonl"
    proc = run_sft_cli(
        [f"run.dir={tmp_path / 'run'}", "run.dry_run=true", f"data.train_path={missing}"],
        tmp_path,
        fresh=True,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "DataError" in lines[0] and str(missing) in lines[0] and "does not exist" in lines[0]
    assert "Traceback" not in proc.stderr


def test_dry_run_refuses_a_run_dir_a_real_run_would_refuse(tmp_path, tiny_overrides):
    trained = run_sft_cli(
        [*tiny_overrides, "train.max_steps=2", "checkpoint.save_steps=2"], tmp_path
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    proc = run_sft_cli([*tiny_overrides, "run.dry_run=true"], tmp_path)
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert "already holds checkpoints" in output and "checkpoint.resume=auto" in output
    resumed = run_sft_cli([*tiny_overrides, "run.dry_run=true", "checkpoint.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumes from step_00000002" in resumed.stdout


def test_help_says_cfg_job_is_no_validation_and_points_to_dry_run():
    text = " ".join(render_help("sft", SFTConfig, "veoptim-sft", "sft").split())
    assert "--cfg job prints the composed config without validating its values" in text
    assert "run.dry_run=true" in text
    assert "run.dry_run: bool = false" in render_help("sft", SFTConfig, "veoptim-sft", "sft")
