"""``Checkpointer.save(within=name)``: a per-name root inside the checkpointer's root (what
the slot store names its saves with), in one process with real DCP files.

Each name is a root of its own: its saves, its retention; another name's saves and the
root's own checkpoints are never touched, and a name that is not one path component is
refused before anything is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import ComponentState, SavedComponent, Staged, TensorSpec
from veoptim.checkpoint.versions import VERSIONS_DIR, latest_complete, published_names
from veoptim.errors import CheckpointError

pytestmark = pytest.mark.starts_processes


class Counter:
    """A JSON count and a small tensor: enough to tell saves apart after a load."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.values = torch.full((3,), float(count))

    def state(self) -> ComponentState:
        return ComponentState(tensors={"values": self.values}, json={"count": self.count})

    def stage(self, saved: SavedComponent) -> Staged:
        buffer = torch.empty_like(self.values)

        def install() -> None:
            self.count = saved.json["count"]
            self.values.copy_(buffer)

        return Staged(
            expected={"values": TensorSpec((3,), torch.float32)},
            buffers={"values": buffer},
            install=install,
        )


def save(checkpointer: Checkpointer, within: str | None, name: str, count: int) -> Path:
    published = checkpointer.save({"counter": Counter(count)}, name, step=count, within=within)
    assert published is not None
    return published.path


def test_saves_within_a_name_live_in_its_own_root_and_load_back(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, fsync=False)
    first = save(checkpointer, "alice", "save_000001", 1)
    second = save(checkpointer, "alice", "save_000002", 2)
    save(checkpointer, "bob", "save_000001", 7)
    save(checkpointer, None, "step_00000003", 3)
    assert first.parent == tmp_path / "alice" / VERSIONS_DIR
    assert sorted(published_names(tmp_path / "alice")) == ["save_000001", "save_000002"]
    assert sorted(published_names(tmp_path / "bob")) == ["save_000001"]
    assert sorted(published_names(tmp_path)) == ["step_00000003"]
    assert latest_complete(tmp_path / "alice") == "save_000002"
    loaded = Counter(0)
    assert checkpointer.load({"counter": loaded}, second) == 2
    assert loaded.count == 2 and torch.equal(loaded.values, torch.full((3,), 2.0))


def test_retention_within_a_name_prunes_that_name_only(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, keep_last=1, fsync=False)
    save(checkpointer, "bob", "save_000001", 1)
    save(checkpointer, "bob", "save_000002", 2)
    for n in range(1, 4):
        save(checkpointer, "alice", f"save_{n:06d}", n)
    assert sorted(published_names(tmp_path / "alice")) == ["save_000003"]
    assert len(os.listdir(tmp_path / "alice" / VERSIONS_DIR)) <= 2  # the superseded one waits
    # negative control: bob's own retention ran when bob saved, and alice's never reached him
    assert sorted(published_names(tmp_path / "bob")) == ["save_000002"]


@pytest.mark.parametrize("within", ["../escape", "a/b", ".hidden", ""])
def test_a_name_that_is_not_one_path_component_is_refused_before_writing(
    tmp_path: Path, within: str
) -> None:
    checkpointer = Checkpointer(tmp_path / "root", fsync=False)
    with pytest.raises(CheckpointError, match="Checkpoint name"):
        save(checkpointer, within, "save_000001", 1)
    assert not (tmp_path / "root").exists() and not (tmp_path / "escape").exists()


def test_a_single_process_save_prints_no_dcp_warning(tmp_path: Path) -> None:
    """DCP warns that it "assumes" a single process on every save without a process group:
    intended here, so the storage silences it and a run's output stays clean. A process of
    its own: pytest's own warning filters would hide the warning here."""
    script = (
        "import torch\n"
        "from veoptim.checkpoint.checkpointer import Checkpointer\n"
        "from veoptim.checkpoint.component import ComponentState\n"
        "class Weights:\n"
        "    def state(self):\n"
        "        return ComponentState(tensors={'w': torch.ones(2)})\n"
        f"Checkpointer({str(tmp_path)!r}, fsync=False).save({{'w': Weights()}}, 'a', step=1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch.distributed is disabled" not in done.stderr
