"""scripts/trace_checkpoint.py: the files a save, a resume, a slot save and a slot load pass
through (at most five checkpoint files outside the storage each; a load at most five with
the agreement included, and one manifest verification), and the one door into the DCP
storage (the raw format's writer and reader, read-ahead, prefault, durability)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_saves_and_loads_pass_five_files_and_enter_the_storage_through_its_door():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "trace_checkpoint.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads(done.stdout)
    assert "checkpoint/storage/raw_writer.py" in trace["save"]["storage_files"]
    assert "checkpoint/storage/raw_reader.py" in trace["resume"]["storage_files"]
    for operation in ("save", "resume", "slot_save", "slot_load"):
        checkpoint = trace[operation]["checkpoint_files"]
        files = checkpoint + trace[operation]["agreement_files"]
        assert "checkpoint/checkpointer.py" in files
        assert trace[operation]["checkpoint_file_count"] == len(checkpoint) <= 5, checkpoint
        assert not any(f.startswith("checkpoint/storage/") for f in files)
        assert set(trace[operation]["callers_into_storage"]) <= {
            "checkpoint/checkpointer.py",
            "checkpoint/disk.py",  # the storage seam's LocalFiles: fsync
        }
        assert trace[operation]["storage_entry_files"] == ["checkpoint/storage/__init__.py"]
    for load in ("resume", "slot_load"):
        assert len(trace[load]["checkpoint_files"] + trace[load]["agreement_files"]) <= 5
        assert trace[load]["manifest_verifications"] == 1, trace[load]
