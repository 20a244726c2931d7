"""Two reader processes running while another process saves repeatedly never see a partial
or mixed checkpoint: every read resolves a name once and finds one complete version, or
(a reader slower than the next save) finds that version removed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.helpers.payload import check_payload, write_payload
from veoptim.checkpoint import step_name, versions
from veoptim.checkpoint.publish import Publisher

pytestmark = pytest.mark.slow

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


@pytest.mark.parametrize("rescans", [versions.RESCANS, 1])
def test_a_scan_outrun_by_a_save_scans_again(tmp_path: Path, monkeypatch, rescans: int) -> None:
    """Two saves land between the scan's listing of the names and its first read: they
    move ``latest`` off the version the scan is about to read, which the second one
    collects, and prune the one listed step name. That scan finds nothing complete; the
    next one finds the newest save (with a single scan, the busy root passes for an empty
    one: the failure this guards against)."""
    root = tmp_path / "ckpts"
    pub = Publisher(root, fsync=False, keep_last=1)

    def save(step: int) -> None:
        for name in (step_name(step), "latest"):
            with pub.write(name, step=step, prunable=name != "latest") as version:
                write_payload(version, step, 64)

    save(1)
    real, raced = versions.read_manifest, []

    def read_manifest_after_a_save(path: Path):  # the other process's save, mid-scan
        if not raced:
            raced.append(path)
            save(2)
            save(3)
        return real(path)

    monkeypatch.setattr(versions, "read_manifest", read_manifest_after_a_save)
    monkeypatch.setattr(versions, "RESCANS", rescans)
    found = versions.newest_complete(root)
    assert raced and versions.published_names(root).keys() == {"latest", step_name(3)}
    if rescans == 1:
        assert found is None
    else:
        assert found is not None and found[0] in ("latest", step_name(3))
        assert check_payload(found[1]) == 3
