"""With ``fsync`` on, everything a version holds is flushed before its name moves to it.

SIGKILL tests cannot see a missing fsync (the page cache outlives the process), so these
tests record the flushes themselves: ``os.fsync`` is wrapped to note the path of every
fd it flushes (``/proc/self/fd``), and ``os.replace``/``os.rename`` to note every move.
Then every data file (DCP shards and ``.metadata``, ``state/*.json``,
``checkpoint.json``), the manifest, every directory of the version and ``.versions`` must
have been fsynced before the ``os.replace`` that moves the name, and the root after it.
A file fsynced under a temporary name and then renamed (the manifest, DCP's metadata)
counts under its final name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint import Publisher, resolve
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import MANIFEST_FILE, link_path, versions_dir

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")


@dataclass
class Recorder:
    """Every fsync (by path) and every move (``os.replace``/``os.rename``), in order."""

    events: list[tuple[str, str, str]] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), ""))
            real_fsync(fd)

        def move(real):
            def wrapper(src, dst, *args, **kwargs):
                real(src, dst, *args, **kwargs)
                self.events.append(("move", os.path.abspath(src), os.path.abspath(dst)))

            return wrapper

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", move(real_replace))
        monkeypatch.setattr(os, "rename", move(real_rename))

    def link_move(self, root: Path, name: str) -> int:
        """Index of the move that replaced the name's link (exactly one)."""
        link = os.path.abspath(link_path(root, name))
        found = [
            i for i, (kind, _, dst) in enumerate(self.events) if kind == "move" and dst == link
        ]
        assert len(found) == 1, f"expected one replace of {link}, got {found}"
        return found[0]

    def flushed_before(self, index: int) -> set[str]:
        """Paths fsynced before event ``index``, followed through later moves (up to it)."""
        flushed = set()
        for i, (kind, path, _) in enumerate(self.events[:index]):
            if kind != "fsync":
                continue
            for later_kind, src, dst in self.events[i + 1 : index]:
                if later_kind == "move" and src == path:
                    path = dst
            flushed.add(path)
        return flushed

    def flushed_after(self, index: int) -> set[str]:
        return {path for kind, path, _ in self.events[index + 1 :] if kind == "fsync"}


def assert_flushed_in_order(recorder: Recorder, root: Path, name: str) -> Path:
    """The ordering contract of docs/checkpoints.md (Guarantees, fsync: true)."""
    version = resolve(root, name)
    replace_at = recorder.link_move(root, name)
    before = recorder.flushed_before(replace_at)
    files = sorted(str(p) for p in version.rglob("*") if p.is_file())
    dirs = sorted(str(p) for p in version.rglob("*") if p.is_dir())
    assert str(version / MANIFEST_FILE) in files
    missing = [p for p in files + dirs + [str(version)] if p not in before]
    assert missing == [], f"not fsynced before the name moved: {missing}"
    real_versions = os.path.realpath(versions_dir(root))
    assert real_versions in before, ".versions not fsynced before the name moved"
    assert os.path.realpath(root) in recorder.flushed_after(replace_at), "root not fsynced"
    return version


@pytest.mark.parametrize(("fmt", "suffix"), [("raw", ".raw"), ("dcp", ".distcp")])
def test_training_checkpoint_is_flushed_before_its_name_moves(tmp_path, monkeypatch, fmt, suffix):
    trainer = build_trainer(tmp_path / "run")
    trainer.train_step()
    root = tmp_path / "ckpt"
    recorder = Recorder()
    recorder.install(monkeypatch)
    save_with(Checkpointer(root, fsync=True, storage_format=fmt), trainer, "step_1")
    version = assert_flushed_in_order(recorder, root, "step_1")
    # The contract covers every kind of file a training checkpoint holds.
    names = {str(p.relative_to(version)) for p in version.rglob("*") if p.is_file()}
    assert {C.INFO_FILE, f"{C.DCP_DIR}/.metadata", MANIFEST_FILE} <= names
    assert any(n.endswith(suffix) for n in names)
    assert any(n.startswith(f"{C.STATE_DIR}/") and n.count("/") == 1 for n in names)
    assert any(n.startswith(f"{C.STATE_DIR}/") and n.count("/") == 2 for n in names)


def test_plain_publisher_write_is_flushed_before_its_name_moves(tmp_path, monkeypatch):
    """Files a writer leaves unflushed (no fsync of its own) are flushed by the publisher,
    for a first save (new root) and for a save that moves an existing name."""
    root = tmp_path / "root"
    recorder = Recorder()
    recorder.install(monkeypatch)
    for attempt in range(2):
        recorder.events.clear()
        with Publisher(root, fsync=True).write("export", step=attempt) as out:
            (out / "a" / "b").mkdir(parents=True)
            (out / "top.bin").write_bytes(b"x" * 1000)
            (out / "a" / "mid.json").write_text("{}")
            (out / "a" / "b" / "deep.bin").write_bytes(bytes(10))
        assert_flushed_in_order(recorder, root, "export")


def test_the_recorder_sees_a_missing_flush(tmp_path, monkeypatch):
    """Negative control: with fsync off nothing is flushed, and the check says so."""
    root = tmp_path / "root"
    recorder = Recorder()
    recorder.install(monkeypatch)
    with Publisher(root, fsync=False).write("export") as out:
        (out / "data.bin").write_bytes(b"x")
    with pytest.raises(AssertionError, match="not fsynced before the name moved"):
        assert_flushed_in_order(recorder, root, "export")
