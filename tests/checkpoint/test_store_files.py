"""The version store's storage seam (``disk.StoreFiles``): a publication makes every change
to the root through it, in the documented order, and a failing replace leaves the name on
its previous version."""

from __future__ import annotations

from pathlib import Path

import pytest

from veoptim.checkpoint import layout
from veoptim.checkpoint.disk import LocalFiles, StoreFiles
from veoptim.checkpoint.faults import PHASES
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import resolve
from veoptim.errors import CheckpointError


class Recording(LocalFiles):
    """The local filesystem, recording each operation as ``(name, path relative to the
    root)``; ``fail``: the operation that raises ``OSError`` instead, when set."""

    def __init__(self, root: Path, fail: str | None = None) -> None:
        super().__init__(fsync=False)
        self.root, self.fail = root, fail
        self.ops: list[tuple[str, str]] = []

    def _note(self, op: str, path: Path | str) -> None:
        rel = Path(path).relative_to(self.root).as_posix() if Path(path) != self.root else "."
        self.ops.append((op, rel))
        if op == self.fail:
            raise OSError(5, f"{op} failed (injected)")

    def make_dir(self, path):
        self._note("make_dir", path)
        super().make_dir(path)

    def write(self, path, data):
        self._note("write", path)
        super().write(path, data)

    def flush(self, files=(), dirs=()):
        for path in [*files, *dirs]:
            self._note("flush", path)
        super().flush(files, dirs)

    def symlink(self, target, path):
        self._note("symlink", path)
        super().symlink(target, path)

    def replace(self, source, destination):
        self._note("replace", destination)
        super().replace(source, destination)

    def unlink(self, path):
        self._note("unlink", path)
        super().unlink(path)

    def remove_tree(self, path):
        self._note("remove_tree", path)
        super().remove_tree(path)

    def reached(self, phase):
        self.ops.append(("reached", phase))


def publish(pub: Publisher, name: str, payload: bytes) -> Path:
    with pub.write(name, step=1) as version:
        (version / "data.bin").write_bytes(payload)
    return resolve(pub.root, name)


def test_local_files_is_a_store_files() -> None:
    files: StoreFiles = LocalFiles()  # the protocol's methods, typed
    assert all(callable(getattr(files, op)) for op in ("make_dir", "write", "flush", "symlink"))


def test_a_publication_goes_through_the_seam_in_order(tmp_path: Path) -> None:
    files = Recording(tmp_path)
    pub = Publisher(tmp_path, files=files)
    version = publish(pub, "step_1", b"one")
    vid = version.name
    ops = [op for op in files.ops if op[0] != "flush" or op[1] != f".versions/{vid}"]
    assert ops[:3] == [
        ("make_dir", ".versions"),
        ("flush", "."),  # .versions durable before any name
        ("make_dir", f".versions/{vid}"),
    ]
    tmp_link = next(path for op, path in ops if op == "symlink")
    assert tmp_link.startswith(layout.TEMP_LINK_PREFIX + "step_1.")
    assert ops[3:] == [
        ("reached", "prepared"),
        ("reached", "written"),
        ("reached", "before_manifest"),
        ("write", f".versions/{vid}/{layout.MANIFEST_FILE}"),
        ("flush", f".versions/{vid}/{layout.MANIFEST_FILE}"),
        ("flush", ".versions"),
        ("reached", "after_manifest"),
        ("symlink", tmp_link),
        ("reached", "before_replace"),
        ("replace", "step_1"),
        ("reached", "after_replace"),
        ("flush", "."),  # the root: the name's move is durable
    ]
    assert {phase for op, phase in ops if op == "reached"} == set(PHASES) - {"retention"}
    # a second save of another name: retention (keep_last) goes through the seam too
    files.ops.clear()
    pruning = Publisher(tmp_path, keep_last=1, files=files)
    publish(pruning, "step_2", b"two")
    assert ("unlink", "step_1") in files.ops
    assert ("reached", "retention") in files.ops


def test_a_failing_replace_leaves_the_name_on_its_previous_version(tmp_path: Path) -> None:
    first = publish(Publisher(tmp_path, fsync=False), "latest", b"first")
    files = Recording(tmp_path, fail="replace")
    with pytest.raises(CheckpointError, match="replace failed"):
        publish(Publisher(tmp_path, files=files), "latest", b"second")
    assert resolve(tmp_path, "latest") == first
    assert (first / "data.bin").read_bytes() == b"first"
    assert sorted(p.name for p in (tmp_path / layout.VERSIONS_DIR).iterdir()) == [first.name]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(layout.TEMP_LINK_PREFIX)]
    assert leftovers == []  # the temporary link went with the failure
    # negative control: the same seam without the failure publishes
    files.fail = None
    second = publish(Publisher(tmp_path, files=files), "latest", b"second")
    assert second != first and resolve(tmp_path, "latest") == second
