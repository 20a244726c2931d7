"""scripts/bench/peer_trl.py: veoptim and TRL train the same thing (the first losses agree
in FP32), so the peer benchmark's ratios compare like with like."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/bench/peer_trl.py"


def run_bench(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "peer.json"
    cmd = [sys.executable, SCRIPT, "--smoke", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.is_file(), proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


def test_smoke_run_verifies_loss_agreement_and_reports_ratios(tmp_path):
    rc, report = run_bench(tmp_path, "--variants", "veoptim_eager,veoptim,trl")
    tiny = report["models"]["tiny"]
    check = tiny["verify_fp32"]
    assert rc == 0 and check["verified"]
    assert check["initial_weights_equal"] and check["lrs_equal"] and check["tokens_equal"]
    assert len(check["losses"]["veoptim"]) == 5 and check["max_rel_loss_diff"] <= 1e-5
    assert set(tiny["runs"]) == {"veoptim_eager", "veoptim", "trl"}
    assert set(tiny["vs_trl"]) == {"veoptim_eager/trl", "veoptim/trl"}
    ratio = tiny["vs_trl"]["veoptim/trl"]
    assert ratio["tokens_per_s"]["median"] > 0 and ratio["peak_rss"]["median"] > 0
    assert 0 < tiny["runs"]["trl"]["bf16_peak_fraction"]["median"] < 1


def test_verification_fails_when_trl_trains_differently(tmp_path):
    # negative control: TRL without the gradient clip takes other steps from the same LRs
    rc, report = run_bench(tmp_path, "--pairs", "0", "--trl-no-clip")
    check = report["models"]["tiny"]["verify_fp32"]
    assert rc == 3 and not check["verified"]
    assert check["lrs_equal"] and check["initial_weights_equal"] and not check["losses_agree"]
