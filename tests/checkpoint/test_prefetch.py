"""A load starts the disk on its rank's shard files before validating (a page-cache hint).

Checked with real files and the real page cache: after eviction, ``prefetch_shards``
makes this rank's files resident (``fincore``), and leaves other ranks' files and
symbolic links alone. Nothing is read into the process, so the hint cannot change
what validation sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from veoptim.checkpoint.raw_reader import prefetch_shards

pytestmark = pytest.mark.skipif(
    shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"),
    reason="needs util-linux fincore and posix_fadvise",
)
SIZE = 4 << 20


def resident(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def write_evicted(path: Path) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(SIZE))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def test_only_this_ranks_files_are_read_ahead(tmp_path):
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    mine = [write_evicted(dcp / "__1_0.raw"), write_evicted(dcp / "__1_1.raw")]
    other = write_evicted(dcp / "__0_0.raw")
    outside = write_evicted(tmp_path / "outside.raw")
    (dcp / "__1_2.raw").symlink_to(outside)
    if any(resident(p) for p in (*mine, other, outside)):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    assert prefetch_shards(dcp, rank=1) == 2
    deadline = time.monotonic() + 30  # the read-ahead is asynchronous
    while not all(resident(p) == SIZE for p in mine):
        assert time.monotonic() < deadline, "this rank's files were not read ahead"
        time.sleep(0.02)
    assert resident(other) == 0 and resident(outside) == 0


def test_a_missing_directory_or_no_files_is_no_error(tmp_path):
    assert prefetch_shards(tmp_path / "missing", rank=0) == 0
    assert prefetch_shards(tmp_path, rank=0) == 0
