"""Two guarantees of a save that a planted bug would otherwise slip past: a save that prunes
keeps the version its name just moved away from (a reader may be in it), and a save one of
whose fsyncs fails raises ``CheckpointError`` with the name still on the previous version.
Real files, real DCP (``Checkpointer``), real retention."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.checkpoint.test_checkpointer_roots import Counter
from tests.checkpoint.test_publish import save
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import published_names
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import resolve
from veoptim.errors import CheckpointError


def test_a_save_that_prunes_while_its_name_moves_keeps_the_old_version(tmp_path: Path) -> None:
    unlimited = Publisher(tmp_path)  # an earlier slice kept every checkpoint
    for step in (1, 2, 3):
        save(unlimited, f"step_{step:08d}", step)
    reader_version = resolve(tmp_path, "step_00000003")  # a reader resolved it just now
    # This slice keeps two: re-publishing step_00000003 moves the name and prunes
    # step_00000001 in the same save, which then removes unreferenced versions.
    moved = save(Publisher(tmp_path, keep_last=2), "step_00000003", 4)
    assert sorted(published_names(tmp_path)) == ["step_00000002", "step_00000003"]
    assert moved != reader_version
    assert reader_version.exists(), "the version the name just moved away from was removed"
    # The next save may collect it: the reader had a save's time to finish.
    save(Publisher(tmp_path, keep_last=2), "step_00000005", 5)
    assert not reader_version.exists()


def test_one_failed_fsync_fails_the_save_and_keeps_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpointer = Checkpointer(tmp_path, fsync=True, write_threads=2)
    first = checkpointer.save({"counter": Counter(1)}, "latest", step=1)
    real_fsync = os.fsync
    failed: list[str] = []

    def fsync_failing_once_on_a_data_file(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not failed and "/dcp/" in path and ".versions" in path and os.path.isfile(path):
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_failing_once_on_a_data_file)
    with pytest.raises(CheckpointError, match="Input/output error"):
        checkpointer.save({"counter": Counter(2)}, "latest", step=2)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert failed, "no fsync of a data file was attempted"
    assert resolve(tmp_path, "latest") == first.path  # the name never moved
    counter = Counter(0)
    checkpointer.load({"counter": counter}, first.path)
    assert counter.count == 1
    leftovers = sorted(os.listdir(tmp_path / ".versions"))
    assert leftovers == [first.path.name]  # the failed version was removed
