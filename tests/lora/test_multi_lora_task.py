"""``python -m tasks.multi_lora``: the multi-LoRA demo end to end, as a user runs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import run_task_cli

EXPORTS = {0: "slot0_uppercase", 1: "slot1_reverse", 2: "slot2_what-is"}
SUMMARY = re.compile(r"slot (\d) \('[^']*'\): loss first ([\d.]+), last ([\d.]+)")


def run_multi_lora_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tasks.multi_lora ARGS`` in a real subprocess, offline, from ``cwd``."""
    return run_task_cli("multi_lora", args, cwd)


def test_demo_trains_checks_continuation_and_exports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_multi_lora_cli(
        [f"run.dir={run_dir}", "run.device=cpu", "train.max_steps=12", "train.micro_batch_size=4",
         "scheduler.warmup_steps=2", "optim.lr=1e-2", "logging.log_every=4"],
        tmp_path,
    )  # fmt: skip
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
