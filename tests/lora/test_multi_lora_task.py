"""``python -m tasks.multi_lora``: the multi-LoRA demo end to end, as a user runs it."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_task_cli

pytestmark = pytest.mark.slow

EXPORTS = {0: "slot0_uppercase", 1: "slot1_reverse", 2: "slot2_what-is"}
SUMMARY = re.compile(r"slot (\d) \('[^']*'\): loss first ([\d.]+), last ([\d.]+)")


def run_multi_lora_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tasks.multi_lora ARGS`` in a real subprocess, offline, from ``cwd``."""
    return run_task_cli("multi_lora", args, cwd)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One 12-step run of the demo (logging every 4 steps) and its run dir."""
    tmp_path = tmp_path_factory.mktemp("multi_lora")
    run_dir = tmp_path / "run"
    proc = run_multi_lora_cli(
        [f"run.dir={run_dir}", "run.device=cpu", "train.max_steps=12", "train.micro_batch_size=4",
         "scheduler.warmup_steps=2", "optim.lr=1e-2", "logging.log_every=4"],
        tmp_path,
    )  # fmt: skip
    return proc, run_dir


def test_demo_trains_checks_continuation_and_exports(demo) -> None:
    proc, run_dir = demo
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "exact continuation: OK" in out, out[-4000:]
    losses = {int(s): (float(first), float(last)) for s, first, last in SUMMARY.findall(out)}
    assert sorted(losses) == [0, 1, 2], out[-4000:]
    for slot, (first, last) in losses.items():
        assert first > last, f"slot {slot}: loss did not drop ({first} -> {last})"
    for name in EXPORTS.values():
        adapter = run_dir / "exports" / "slots" / name
        assert (adapter / "adapter_model.safetensors").is_file(), name
        assert (adapter / "adapter_config.json").is_file(), name


def test_task_matching_no_prompt_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run_multi_lora_cli([f"run.dir={tmp_path / 'run'}", "data.tasks=[nomatch]"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = [line for line in out.splitlines() if "Error" in line]
    assert len(errors) == 1 and "DataError" in errors[0] and "'nomatch'" in errors[0], out


def test_demo_writes_metrics_per_slot_and_the_resolved_config(demo) -> None:
    """Like every task: ``metrics.jsonl`` (a record per task slot at each logged step) and
    the resolved ``config.yaml`` in the run dir."""
    proc, run_dir = demo
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tasks = {0: "Uppercase", 1: "Reverse", 2: "What is"}
    assert sorted((r["slot"], r["step"]) for r in records) == [
        (slot, step) for slot in tasks for step in (4, 8, 12)
    ]
    for r in records:
        assert set(r) == {"step", "slot", "task", "loss", "lr", "grad_norm", "tokens"}, r
        assert r["task"] == tasks[r["slot"]]
        assert r["loss"] > 0 and 0 < r["lr"] <= 1e-2 and math.isfinite(r["grad_norm"])
        assert r["tokens"] > 0
    last = {int(slot): float(last) for slot, _, last in SUMMARY.findall(out)}
    for r in records:
        if r["step"] == 12:  # the summary's last loss is the slot's last record
            assert f"{r['loss']:.4f}" == f"{last[r['slot']]:.4f}"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["dir"] == str(run_dir)
    assert config["train"]["max_steps"] == 12 and config["lora"]["num_slots"] == 4
    assert config["data"]["tasks"] == list(tasks.values())


def test_the_demo_trains_its_slots_on_a_4bit_base(tmp_path: Path) -> None:
    """``model.quant=nf4``: every slot on one NF4 base; the continuation check is bitwise."""
    run_dir = tmp_path / "run"
    proc = run_multi_lora_cli(
        [f"run.dir={run_dir}", "run.device=cpu", "train.max_steps=8", "train.micro_batch_size=4",
         "scheduler.warmup_steps=2", "optim.lr=1e-2", "logging.log_every=4", "model.quant=nf4",
         "model.dtype=bf16", "optim=master_fp32_adamw"],
        tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "exact continuation: OK" in out, out[-4000:]
    losses = {int(s): (float(first), float(last)) for s, first, last in SUMMARY.findall(out)}
    assert sorted(losses) == [0, 1, 2] and all(f > last for f, last in losses.values()), out
    base = json.loads(
        (run_dir / "exports" / "slots" / EXPORTS[0] / "veoptim_base.json").read_text()
    )
    assert base["quant"] == "nf4"
