"""scripts/bench/peer_trl.py: veoptim and TRL train the same thing (the first losses agree
in FP32), so the peer benchmark's ratios compare like with like."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.peer_trl import VERIFY_FAILED_EXIT, verification_failed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/bench/peer_trl.py"


def test_smoke_run_verifies_loss_agreement_rejects_its_control_and_reports_ratios(tmp_path):
    out = tmp_path / "peer.json"
    cmd = [sys.executable, SCRIPT, "--smoke", "--control", "--out", str(out),
           "--variants", "veoptim,trl"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.is_file(), proc.stderr[-3000:]
    tiny = json.loads(out.read_text())["models"]["tiny"]
    check = tiny["verify_fp32"]
    assert proc.returncode == 0 and check["verified"]
    assert check["initial_weights_equal"] and check["lrs_equal"] and check["tokens_equal"]
    assert len(check["losses"]["veoptim"]) == 5 and check["max_rel_loss_diff"] <= 1e-5
    # negative control: TRL without the gradient clip takes other steps from the same LRs
    control = check["control"]
    assert not control["verified"] and not control["losses_agree"]
    assert control["lrs_equal"] and control["initial_weights_equal"]
    assert set(tiny["runs"]) == {"veoptim", "trl"} and set(tiny["vs_trl"]) == {"veoptim/trl"}
    ratio = tiny["vs_trl"]["veoptim/trl"]
    assert ratio["tokens_per_s"]["median"] > 0 and ratio["peak_rss"]["median"] > 0
    assert 0 < tiny["runs"]["trl"]["bf16_peak_fraction"]["median"] < 1


def test_a_rejected_pair_or_an_accepted_control_fails_the_run():
    assert VERIFY_FAILED_EXIT == 3
    assert not verification_failed({"verified": True})
    assert not verification_failed({"verified": True, "control": {"verified": False}})
    assert verification_failed({"verified": False})
    assert verification_failed({"verified": False, "control": {"verified": False}})
    assert verification_failed({"verified": True, "control": {"verified": True}})
