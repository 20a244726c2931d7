"""Real filesystem faults during a save keep the previous version published, and the error
names the path: disk full (a tiny tmpfs), file too large (RLIMIT_FSIZE), permission denied
(an unwritable directory; as root the writer runs without the capabilities that bypass
file modes).
Cleanup that fails is logged and never fails the save."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoint.helpers.payload import write_payload
from veoptim.checkpoint import layout
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import resolve

pytestmark = pytest.mark.slow

FAULT_WRITER = Path(__file__).parent / "helpers" / "fault_writer.py"


def parse(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def fault_writer(root: Path, saves: str, *extra: str) -> list[str]:
    return [sys.executable, str(FAULT_WRITER), str(root), "--saves", saves, *extra]


@pytest.fixture
def shared_root(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint root whose directory modes are restored after the test."""
    try:
        yield tmp_path / "ckpts"
    finally:
        for dirpath, _, _ in os.walk(tmp_path):
            os.chmod(dirpath, 0o755)


def run_unprivileged(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` so that directory modes apply to it.

    As root, the writer keeps uid 0 but loses the capabilities that bypass file modes
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER), so a 0555 directory really
    refuses it with EACCES, as it would refuse any user.
    """
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv(1) is needed to drop root's permission bypass")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def publish_step_one(root: Path) -> Path:
    with Publisher(root).write("ckpt", step=1) as version:
        write_payload(version, 1, 64)
    return resolve(root, "ckpt")


def test_disk_full_keeps_previous_version_and_names_the_path(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not available")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size=1m tmpfs "$1" || exit 77; shift; exec "$@"'
    cmd = ["unshare", "-rm", "sh", "-c", script, "sh", str(mnt)]
    cmd += fault_writer(mnt, "1:1024,2:2000000,3:1024")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and not proc.stdout:
        pytest.skip(f"cannot mount a private tmpfs: {proc.stderr.strip()}")
    first, full, after = parse(proc.stdout)
    assert first["error"] is None and first["published_step"] == 1
    assert "No space left on device" in full["error"]
    assert f"{mnt}/{layout.VERSIONS_DIR}/ckpt." in full["error"]  # names the path
    assert full["published_step"] == 1
    assert len(full["versions"]) == 1  # the partial new version was removed
    assert after["error"] is None and after["published_step"] == 3


def test_file_too_large_keeps_previous_version(tmp_path: Path) -> None:
    proc = subprocess.run(
        fault_writer(tmp_path, "1:1024,2:200000,3:1024", "--fsize-limit", "65536"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    first, too_big, after = parse(proc.stdout)
    assert first["error"] is None
    assert "File too large" in too_big["error"] and str(tmp_path) in too_big["error"]
    assert too_big["published_step"] == 1 and len(too_big["versions"]) == 1
    assert after["error"] is None and after["published_step"] == 3


def test_permission_denied_when_preparing_keeps_previous_version(shared_root: Path) -> None:
    old = publish_step_one(shared_root)
    os.chmod(shared_root / layout.VERSIONS_DIR, 0o555)
    os.chmod(shared_root, 0o555)
    proc = run_unprivileged(fault_writer(shared_root, "2:1024"))
    (result,) = parse(proc.stdout)
    assert "Permission denied" in result["error"], proc.stderr
    assert f"{shared_root}/{layout.VERSIONS_DIR}" in result["error"]
    assert result["published_step"] == 1 and resolve(shared_root, "ckpt") == old


def test_permission_denied_when_publishing_keeps_previous_version(shared_root: Path) -> None:
    old = publish_step_one(shared_root)
    os.chmod(shared_root / layout.VERSIONS_DIR, 0o777)  # the version can be written...
    os.chmod(shared_root, 0o555)  # ...but the name cannot be moved
    proc = run_unprivileged(fault_writer(shared_root, "2:1024"))
    (result,) = parse(proc.stdout)
    assert "publish of" in result["error"] and "Permission denied" in result["error"]
    assert f"{shared_root}/{layout.TEMP_LINK_PREFIX}ckpt" in result["error"]
    assert result["published_step"] == 1 and resolve(shared_root, "ckpt") == old
    assert result["versions"] == [old.name]  # the unpublished version was removed


def test_cleanup_failure_is_logged_and_the_save_succeeds(shared_root: Path) -> None:
    old = publish_step_one(shared_root)  # owned by us, undeletable for the writer below
    os.chmod(shared_root, 0o777)
    os.chmod(shared_root / layout.VERSIONS_DIR, 0o777)
    os.chmod(old, 0o555)
    proc = run_unprivileged(fault_writer(shared_root, "2:1024,3:1024"))
    second, third = parse(proc.stdout)
    assert second["error"] is None and third["error"] is None, proc.stderr
    assert third["published_step"] == 3
    assert "could not remove" in proc.stderr and old.name in proc.stderr
    assert old.exists()
