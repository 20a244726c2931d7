"""The slot store's references: a name (its newest complete save), ``<name>/save_<n>`` or a
path inside the root each resolve to one version, verified against its manifest once, and
say whether it is weights-only (read by the checkpoint package, not by the store)."""

from __future__ import annotations

from pathlib import Path

import pytest

import veoptim.checkpoint.versions as versions
from veoptim.errors import CheckpointError
from veoptim.slots.store import SlotStore
from veoptim.state import JSONState


class Progress:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    """``alice`` saved twice (the second weights-only), ``bob`` once."""
    store = SlotStore(tmp_path / "slots", fsync=False)
    for name, weights_only in (("alice", False), ("alice", True), ("bob", False)):
        store.save(name, {"progress": JSONState(Progress(1))}, layout={}, weights_only=weights_only)
    return store


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every manifest verification from here on, by version directory."""
    seen: list[Path] = []
    real = versions.verify

    def counted(version: Path, manifest, **kwargs) -> None:
        seen.append(Path(version))
        real(version, manifest, **kwargs)

    monkeypatch.setattr(versions, "verify", counted)
    return seen


def test_a_name_resolves_to_its_newest_save_verified_once(store, verifications):
    path, weights_only = store.resolve("alice")
    assert path == (store.root / "alice" / "save_000002").resolve()
    assert weights_only
    assert verifications == [path]


@pytest.mark.parametrize("ref", ["alice/save_000001", "path"])
def test_a_save_or_a_path_resolves_verified_once(store, verifications, ref):
    first = (store.root / "alice" / "save_000001").resolve()
    path, weights_only = store.resolve(first if ref == "path" else ref)
    assert (path, weights_only) == (first, False)
    assert verifications == [first]


def test_a_load_by_name_reads_the_newest_save(store):
    store.save("bob", {"progress": JSONState(Progress(7))}, layout={}, weights_only=False)
    path, _ = store.resolve("bob")
    live = Progress(0)
    store.load({"progress": JSONState(live)}, path, exact=True)
    assert live.step == 7


def test_a_name_without_a_complete_save_is_refused(store):
    (store.root / "carol").mkdir()
    with pytest.raises(CheckpointError) as info:
        store.resolve("carol")
    assert str(info.value).endswith(
        f"there is no complete slot checkpoint named 'carol' in {store.root}."
    )


def test_a_save_whose_files_changed_is_refused_by_its_manifest(store):
    path, _ = store.resolve("bob")
    (path / "state" / "progress.json").write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match="its manifest"):
        store.resolve("bob/save_000001")
    with pytest.raises(CheckpointError, match="no complete slot checkpoint named 'bob'"):
        store.resolve("bob")  # the newest complete save: there is none left
