"""metrics.jsonl after a crash and a resume: one valid record per step of the history."""

from __future__ import annotations

import json
import logging

from tasks.runner import run_task
from tests.conftest import compose_sft


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_records_after_the_checkpoint_and_a_torn_line(tiny_overrides, tmp_path):
    """As after a SIGKILL mid-write at step 5: the file holds steps 1-4 and a torn line, the
    newest checkpoint is step 3. The resumed run trains step 4 again and logs it once."""
    overrides = tiny_overrides + ["checkpoint.save_at_end=false", "checkpoint.save_steps=3"]
    run_task(compose_sft(overrides))
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 5, "loss": 1.2')  # the bytes a kill mid-write leaves
    first = {json.loads(line)["step"]: line for line in metrics.read_text().splitlines()[:4]}
    run_task(compose_sft(overrides + ["checkpoint.resume=auto"]))
    assert _steps(metrics) == [1, 2, 3, 4]
    lines = metrics.read_text().splitlines()
    assert lines[:3] == [first[1], first[2], first[3]], "records up to the checkpoint are kept"


def test_fresh_run_in_a_used_run_dir_moves_the_old_metrics_aside(tiny_overrides, tmp_path, caplog):
    run_task(compose_sft(tiny_overrides))
    with caplog.at_level(logging.WARNING):
        run_task(compose_sft(tiny_overrides + ["train.max_steps=2", "checkpoint.overwrite=true"]))
    run_dir = tmp_path / "run"
    assert _steps(run_dir / "metrics.jsonl") == [1, 2]
    (aside,) = run_dir.glob("metrics.jsonl.before-*")
    assert _steps(aside) == [1, 2, 3, 4]
    assert "earlier run" in caplog.text
