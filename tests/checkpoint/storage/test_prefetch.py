"""A load starts reading its rank's shard files into the page cache before validating.

Checked with real files and the real page cache: after eviction, ``ShardPrefetch`` makes
this rank's files resident (``fincore``) in full up to its budget, also files many times
longer than the kernel's read-ahead window (what one ``POSIX_FADV_WILLNEED`` call covers: the negative
control shows such a hint leaving most of a file unread), and leaves other ranks' files
and symbolic links alone. Nothing is read into the process's state, so it cannot change
what validation sees.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from veoptim.checkpoint.storage.readahead import BUDGET, CHUNK, ShardPrefetch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"),
        reason="needs util-linux fincore and posix_fadvise",
    ),
]
SIZE = 8 * CHUNK + 4321  # 32 MiB and a partial chunk: several read-ahead windows


def resident(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def write_evicted(path: Path, size: int = SIZE) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def page_rounded(size: int) -> int:
    return -(-size // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")


def test_this_ranks_files_are_read_in_full(tmp_path):
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    mine = [write_evicted(dcp / "__1_0.raw"), write_evicted(dcp / "__1_1.raw", 1000)]
    other = write_evicted(dcp / "__0_0.raw", CHUNK)
    outside = write_evicted(tmp_path / "outside.raw", CHUNK)
    (dcp / "__1_2.raw").symlink_to(outside)
    if any(resident(p) for p in (*mine, other, outside)):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    prefetch = ShardPrefetch(dcp, rank=1)
    assert prefetch.files == 2
    prefetch.join(timeout=60)
    assert [resident(p) for p in mine] == [page_rounded(SIZE), page_rounded(1000)]
    assert resident(other) == 0 and resident(outside) == 0


def test_no_more_than_the_budget_is_read_ahead(tmp_path):
    path = write_evicted(tmp_path / "__0_0.raw", BUDGET + 8 * CHUNK)
    if resident(path):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    ShardPrefetch(tmp_path, rank=0).join(timeout=60)
    # the budget, and at most one read-ahead window the kernel started beyond it
    assert BUDGET <= resident(path) < BUDGET + 8 * CHUNK


def test_negative_control_one_willneed_hint_leaves_most_of_a_long_file_unread(tmp_path):
    path = write_evicted(tmp_path / "__0_0.raw")
    if resident(path):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
    time.sleep(0.5)  # the hint's reads are asynchronous
    if resident(path) == page_rounded(SIZE):
        pytest.skip("this kernel reads the whole file ahead on one hint")
    assert resident(path) < page_rounded(SIZE)


def test_a_missing_directory_or_no_files_is_no_error(tmp_path):
    assert ShardPrefetch(tmp_path / "missing", rank=0).files == 0
    assert ShardPrefetch(tmp_path, rank=0).files == 0
