"""Slot checkpoints: distinct retained versions per name, pinned loads, per-name
retention, sampler checkpoints, and failures that stay with the slot that had them."""

from __future__ import annotations

import pytest

from tests.slots.helpers import all_states, assert_unchanged, build, differences, train
from veoptim.checkpoint.layout import published_names
from veoptim.errors import CheckpointError, SlotError, SlotStateInvalidError


@pytest.fixture
def trainer(tmp_path):
    trainer = build(tmp_path, **{"slots.keep_last": 2})
    for slot in range(3):
        trainer.create_slot(slot)
    train(trainer, 2, [0, 1, 2])
    return trainer


def test_repeated_saves_are_distinct_versions_and_a_pinned_one_loads_its_state(trainer):
    first = trainer.save_slot(0, "alice")
    at_first = trainer.slot_state(0)
    train(trainer, 1, [0], start=100)
    second = trainer.save_slot(0, "alice")
    at_second = trainer.slot_state(0)
    assert first != second and first.is_dir() and second.is_dir()
    trainer.load_slot(3, first)
    assert differences(at_first, trainer.slot_state(3)) == []
    trainer.load_slot(3, "alice/save_000001")
    assert differences(at_first, trainer.slot_state(3)) == []
    trainer.load_slot(3, "alice")  # the newest save
    assert differences(at_second, trainer.slot_state(3)) == []


def test_retention_counts_each_name_alone(trainer):
    root = trainer.store.root
    trainer.save_slot(1, "bob")
    for step in range(3):
        train(trainer, 1, [0], start=200 + 10 * step)
        trainer.save_slot(0, "alice")
    assert sorted(published_names(root / "alice")) == ["save_000002", "save_000003"]
    assert sorted(published_names(root / "bob")) == ["save_000001"]
    trainer.load_slot(3, "bob")
    assert differences(trainer.slot_state(1), trainer.slot_state(3)) == []


def test_sampler_checkpoint_loads_weights_only(trainer):
    trainer.save_slot(0, "sampler", with_optimizer=False)
    before = all_states(trainer)
    with pytest.raises(SlotError, match="sampler checkpoint.*load_optimizer=False") as info:
        trainer.load_slot(1, "sampler")
    assert info.value.slot == 1
    assert_unchanged(before, trainer)
    trainer.load_slot(3, "sampler", load_optimizer=False)
    loaded = trainer.slot_state(3)
    assert differences(before[0], loaded) and loaded["steps"] == 0
    assert all((before[0]["weights"][n] == w).all() for n, w in loaded["weights"].items())


def test_a_failed_save_is_that_slots_error_and_others_train_on(trainer):
    trainer.save_slot(0, "alice")
    saved = trainer.slot_state(0)
    train(trainer, 1, [0, 1, 2], start=300)

    def fail(phase: str) -> None:
        if phase == "before_manifest":
            raise OSError(28, "No space left on device")

    trainer.store.fault_hook = fail
    before = all_states(trainer)
    with pytest.raises(
        SlotError, match="slot 0: saving it as 'alice' failed.*No space left"
    ) as info:
        trainer.save_slot(0, "alice")
    assert info.value.slot == 0
    assert_unchanged(before, trainer)
    trainer.store.fault_hook = None
    train(trainer, 1, [1, 2], start=400)  # the other tenants keep training
    trainer.save_slot(1, "bob")
    trainer.load_slot(3, "alice")  # the previous save of the name is intact
    assert differences(saved, trainer.slot_state(3)) == []


def test_a_load_failing_after_its_first_write_invalidates_only_that_slot(trainer):
    trainer.save_slot(0, "alice")

    def fail(phase: str) -> None:
        if phase == "apply:adapter":
            raise RuntimeError("device lost")

    trainer.store.fault_hook = fail
    others = {s: trainer.slot_state(s) for s in (0, 2)}
    with pytest.raises(SlotStateInvalidError, match="slot 1: loading .* failed after"):
        trainer.load_slot(1, "alice")
    trainer.store.fault_hook = None
    for slot, state in others.items():
        assert differences(state, trainer.slot_state(slot)) == []
    with pytest.raises(SlotStateInvalidError):
        train(trainer, 1, [1])
    train(trainer, 1, [0, 2], start=500)
    trainer.load_slot(1, "alice")  # a good load makes it usable again
    train(trainer, 1, [1], start=600)


def test_delete_removes_every_save_and_export_of_a_name_manifest_first(trainer, monkeypatch):
    import shutil

    from veoptim.checkpoint import disk
    from veoptim.checkpoint.versions import latest_complete

    for _ in range(2):
        trainer.save_slot(0, "gone")
    trainer.save_slot(1, "kept")
    export = trainer.export_slot(0, "gone")
    assert export.is_dir() and latest_complete(trainer.store.root / "gone") == "save_000002"
    # interrupted after the manifests went: no save of the name is complete any more
    calls = []
    real = shutil.rmtree

    def fail_once(path, *args, **kwargs):
        if not calls:
            calls.append(path)
            raise OSError("interrupted")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(disk.shutil, "rmtree", fail_once)
    with pytest.raises(CheckpointError, match="deleting slot checkpoint .gone."):
        trainer.delete_checkpoint("gone")
    assert (trainer.store.root / "gone").is_dir() and calls
    assert latest_complete(trainer.store.root / "gone") is None
    monkeypatch.setattr(disk.shutil, "rmtree", real)
    trainer.delete_checkpoint("gone")
    assert not (trainer.store.root / "gone").exists() and not export.exists()
    trainer.load_slot(3, "kept")  # another name is untouched
    assert differences(trainer.slot_state(1), trainer.slot_state(3)) == []
    trainer.delete_checkpoint("never-saved")  # nothing there: nothing to do
