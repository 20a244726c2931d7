"""scripts/trace_checkpoint.py: the files a save and a resume pass through, and the one door
into the DCP storage (the raw format's writer and reader, read-ahead, prefault)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_save_and_resume_reach_the_storage_only_through_the_checkpointer():
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "trace_checkpoint.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads(done.stdout)
    assert "checkpoint/raw_writer.py" in trace["save"]["storage_files"]
    assert "checkpoint/raw_reader.py" in trace["resume"]["storage_files"]
    for operation in ("save", "resume"):
        assert trace[operation]["callers_into_storage"] == ["checkpoint/checkpointer.py"]
        assert "checkpoint/checkpointer.py" in trace[operation]["mechanism_files"]
