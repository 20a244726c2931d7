"""scripts/bench/sampling.py: the decode part's sides compute the same greedy tokens (the
sampler through the base and through a slot, ``transformers`` ``generate`` on the served
base's weights and on the slot's adapter as a PEFT LoRA), and its report carries the
ratios of one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.starts_processes

REPO = Path(__file__).resolve().parents[2]


def test_smoke_decode_matches_generate_and_reports_ratios(tmp_path):
    out = tmp_path / "sampling.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench/sampling.py", "--smoke", "--threads", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    tiny = json.loads(out.read_text())["decode"]["tiny"]
    assert tiny["same_tokens"]
    ratios = tiny["time_ratio_vs_generate"]
    assert set(ratios) == {"base", "slot", "group", "group_unshared"}
    assert set(tiny["time_ratio_vs_peft_generate"]) == {"slot", "group", "group_unshared"}
    assert all(r > 0 for r in ratios.values())
    assert tiny["tokens_per_s"]["group"] > 0 and tiny["new_tokens"] == 8
