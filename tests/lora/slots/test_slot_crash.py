"""SIGKILL during a slot save (a real subprocess): the name still loads a complete save —
the previous one while the new one is unpublished — and the next save succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.lora.slots.helpers import build, differences
from veoptim.lora.slots.store import SlotStore

CHILD = "tests.lora.slots.slot_crash_child"
#: Save phases in order: DCP and JSON written, manifest, name moved, retention.
PHASES = ("write", "before_manifest", "after_manifest", "before_replace", "after_replace")
NEW_VISIBLE = {"after_replace"}


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return build(tmp_path_factory.mktemp("reader"))


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_during_a_slot_save_leaves_a_loadable_save(tmp_path: Path, phase: str, reader):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", CHILD, str(tmp_path), phase],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    expected = torch.load(tmp_path / ("v2.pt" if phase in NEW_VISIBLE else "v1.pt"))
    reader.store = SlotStore(tmp_path / "checkpoints" / "slots")
    reader.load_slot(0, "alice")
    assert differences(expected, reader.slot_state(0)) == []
    reader.save_slot(0, "alice")  # the next save succeeds over the debris
    reader.load_slot(1, "alice")
    assert differences(expected, reader.slot_state(1)) == []
