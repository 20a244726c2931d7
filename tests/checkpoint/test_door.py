"""``veoptim.checkpoint`` is the door: the ``Checkpointer`` and the component contract are
importable from the package itself, each the very object its module defines."""

from __future__ import annotations

import veoptim.checkpoint as door
from veoptim.checkpoint import checkpointer, component


def test_the_package_exports_the_checkpointer_and_the_contract():
    assert door.Checkpointer is checkpointer.Checkpointer
    for name in ("ComponentState", "SavedComponent", "Staged", "StateComponent", "TensorSpec"):
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
