"""Two reader processes running while another process saves repeatedly never see a partial
or mixed checkpoint: every read resolves a name once and finds one complete version, or
(a reader slower than the next save) finds that version removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.checkpoint.helpers.payload import write_payload
from veoptim.checkpoint.publish import Publisher

HELPERS = Path(__file__).parent / "helpers"
SAVES = 30


def test_concurrent_readers_never_see_a_partial_checkpoint(tmp_path: Path) -> None:
    root, stop = tmp_path / "ckpts", tmp_path / "stop"
    pub = Publisher(root, fsync=False)
    for name in ("step_00000000", "latest"):
        with pub.write(name, step=0, prunable=name != "latest") as version:
            write_payload(version, 0, 64)
    readers = [
        subprocess.Popen(
            [sys.executable, str(HELPERS / "reader.py"), str(root), str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    writer = subprocess.run(
        [
            sys.executable,
            str(HELPERS / "crash_writer.py"),
            str(root),
            "--loop",
            "--count",
            str(SAVES),
            "--keep-last",
            "3",
            "--shard-bytes",
            "50000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    stop.touch()
    reports = [json.loads(r.communicate(timeout=60)[0]) for r in readers]
    assert writer.returncode == 0, writer.stderr
    for report in reports:
        assert report["failures"] == []
        assert report["reads"] >= 20 and report["vanished"] < report["reads"]
    seen = set().union(*(r["steps"] for r in reports))
    assert len(seen) > 2, f"readers saw too few versions to have overlapped saves: {seen}"
