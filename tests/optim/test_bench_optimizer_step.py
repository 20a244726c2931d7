"""scripts/bench/optimizer_step.py: any --numel splits into positive sizes that sum to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.optimizer_step import split_sizes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("numel", [1, 100, 1023, 1024, 100_000, 999_999, 1 << 23, (1 << 30) + 7])
def test_split_sizes_are_positive_and_sum_to_numel(numel):
    sizes = split_sizes(numel)
    assert sum(sizes) == numel and all(n > 0 for n in sizes)


def test_small_run_writes_one_json_with_every_requested_variant(tmp_path):
    out = tmp_path / "opt.json"
    variants = "full_fp32_adamw_bf16_params,cpu_offload_adamw_bf16_params,host_update_bf16_params"
    cmd = [sys.executable, "scripts/bench/optimizer_step.py", "--numel", "5000", "--rounds", "1"]
    cmd += ["--threads", "1", "--variants", variants, "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"torch_fused_adamw_fp32", *variants.split(",")}
    assert result["numel"] == 5000 and result["device"] == "cpu"
