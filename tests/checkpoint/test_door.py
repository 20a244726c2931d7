"""``veoptim.checkpoint`` is the door: the ``Checkpointer``, the component contract and the
reader of what a version holds are importable from the package itself, each the very
object its module defines."""

from __future__ import annotations

import pytest

import veoptim.checkpoint as door
from veoptim.checkpoint import checkpointer, component
from veoptim.errors import CheckpointError
from veoptim.state import JSONState


def test_the_package_exports_the_checkpointer_and_the_contract():
    assert door.Checkpointer is checkpointer.Checkpointer
    contract = ("ComponentState", "SavedComponent", "Staged", "StateComponent", "TensorSpec")
    for name in (*contract, "CheckpointInfo", "read_info"):
        assert getattr(door, name) is getattr(component, name), name


def test_every_exported_name_resolves_and_is_listed():
    assert all(getattr(door, name, None) is not None for name in door.__all__)
    assert set(door.__all__) <= set(dir(door))
    try:
        door.NotAName  # noqa: B018 - the lookup is the check
    except AttributeError as exc:
        assert "has no attribute 'NotAName'" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_read_info_describes_a_version_and_refuses_what_is_not_one(tmp_path):
    class Progress:
        def state_dict(self) -> dict:
            return {"step": 4}

        def load_state_dict(self, state: dict) -> None: ...

    saver = door.Checkpointer(tmp_path / "root", fsync=False)
    full = saver.save({"progress": JSONState(Progress())}, "a", step=4).path
    subset = saver.save({"progress": JSONState(Progress())}, "b", step=5, weights_only=True).path
    assert door.read_info(full) == door.CheckpointInfo(
        step=4, world_size=1, weights_only=False, components=("progress",)
    )
    assert door.read_info(subset).weights_only and door.read_info(subset).step == 5
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "checkpoint.json").write_text('{"format": "hf"}')
    with pytest.raises(CheckpointError, match="does not describe a veoptim training checkpoint"):
        door.read_info(tmp_path / "export")
    with pytest.raises(CheckpointError, match="checkpoint.json is missing"):
        door.read_info(tmp_path)
