"""``Checkpointer.resolve`` describes a version from one verified manifest read, and
``Checkpointer.read`` returns what was saved, bitwise, or refuses before returning
anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from veoptim.checkpoint import Checkpointer, ComponentState, storage, versions
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import CheckpointDescription
from veoptim.checkpoint.component import SavedEntry, TensorSpec
from veoptim.errors import CheckpointError


class Saved:
    """A component that only saves (``read`` never stages or installs anything)."""

    def __init__(self, state: ComponentState) -> None:
        self._state = state

    def state(self) -> ComponentState:
        return self._state

    def stage(self, saved):  # pragma: no cover - never loaded here
        raise AssertionError("read must not stage")


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(4, 3, generator=generator).to(torch.bfloat16),
        "b": torch.randn(5, generator=generator),
        "steps": torch.arange(6, dtype=torch.int64),
    }


def components() -> dict[str, Saved]:
    return {
        "model": Saved(ComponentState(tensors=weights())),
        "progress": Saved(ComponentState(json={"step": 3, "tokens": [1, 2]})),
        "rng": Saved(ComponentState(json={"seed": 11}, json_per_rank=True)),
        "opt": Saved(ComponentState(tensors={"m": torch.ones(2)}, json={"lr": 0.5})),
    }


@pytest.fixture
def saver(tmp_path: Path) -> Checkpointer:
    saver = Checkpointer(tmp_path / "root", fsync=False)
    saver.run = "run-a"
    saver.save(components(), "full", step=3)
    subset = {"model": components()["model"]}
    saver.save(subset, "weights", step=4, weights_only=True)
    return saver


# ---------------------------------------------------------------- resolve
def test_resolve_describes_the_version_with_its_components_and_their_kinds(saver):
    described = saver.resolve("full")
    assert isinstance(described, CheckpointDescription)
    assert described.path == (saver.root / "full").resolve()
    assert (described.name, described.step, described.run) == ("full", 3, "run-a")
    assert not described.weights_only
    assert described.components == (
        SavedEntry("model", tensors=True, json=None),
        SavedEntry("progress", tensors=False, json=C.JSON_SHARED),
        SavedEntry("rng", tensors=False, json=C.JSON_PER_RANK),
        SavedEntry("opt", tensors=True, json=C.JSON_SHARED),
    )


def test_resolve_tells_a_weights_only_version_and_auto_finds_the_newest(saver):
    newest = saver.resolve("auto", run="run-a")
    assert (newest.name, newest.step, newest.weights_only) == ("weights", 4, True)
    assert newest.components == (SavedEntry("model", tensors=True, json=None),)
    assert saver.resolve("auto", run="another run") is None


def test_resolve_reads_and_verifies_the_manifest_once(saver, monkeypatch):
    reads, verified = [], []
    real_read, real_verify = versions.read_manifest, versions.verify
    monkeypatch.setattr(versions, "read_manifest", lambda p: reads.append(p) or real_read(p))
    monkeypatch.setattr(
        versions, "verify", lambda p, m, **kw: verified.append(p) or real_verify(p, m, **kw)
    )
    described = saver.resolve("full")
    assert reads == verified == [described.path]


def test_resolve_refuses_a_version_that_is_not_a_training_checkpoint(saver):
    with saver.publisher.write("export", kind="export") as version:
        (version / C.INFO_FILE).write_text('{"format": "hf"}')
    with pytest.raises(CheckpointError, match="does not describe a veoptim training checkpoint"):
        saver.resolve("export")


# ---------------------------------------------------------------- read
def test_read_returns_what_was_saved_bitwise(saver):
    read = saver.read(saver.resolve("full"), {"model": None, "opt": None}, json=("progress", "rng"))
    saved = weights()
    assert read.tensors["model"].keys() == saved.keys()
    for key, tensor in saved.items():
        got = read.tensors["model"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor), key
    assert torch.equal(read.tensors["opt"]["m"], torch.ones(2))
    assert read.json == {"progress": {"step": 3, "tokens": [1, 2]}, "rng": {"seed": 11}}
    assert read.info.step == 3 and not read.info.weights_only
    assert read.saved["model"]["w"] == TensorSpec((4, 3), torch.bfloat16)


def test_read_refuses_a_mismatched_inventory_before_reading(saver, monkeypatch):
    reads = []
    monkeypatch.setattr(storage, "load_tensors", lambda *a, **kw: reads.append(a))
    full = saver.resolve("full")
    expected = {key: TensorSpec(tuple(t.shape), t.dtype) for key, t in weights().items()}
    wrong = {**expected, "w": TensorSpec((3, 4), torch.bfloat16)}
    with pytest.raises(CheckpointError, match="another shape/dtype: w"):
        saver.read(full, {"model": wrong})
    with pytest.raises(CheckpointError, match="no state for missing"):
        saver.read(full, {"missing": None})
    assert reads == []
    saver.read(full, {"model": expected})  # negative control: the saved inventory is read
    assert len(reads) == 1


@pytest.mark.parametrize("damage", ["info", "metadata", "json"])
def test_read_refuses_a_corrupted_checkpoint(saver, tmp_path, damage, monkeypatch):
    full = saver.resolve("full").path
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in full.rglob("*"):
        target = copy / item.relative_to(full)
        target.parent.mkdir(parents=True, exist_ok=True)
        if item.is_file():
            target.write_bytes(item.read_bytes())
    if damage == "info":
        info = json.loads((copy / C.INFO_FILE).read_text())
        info[C.INFO_FORMAT_VERSION] = 99
        (copy / C.INFO_FILE).write_text(json.dumps(info))
    elif damage == "metadata":
        (copy / C.DCP_DIR / ".metadata").write_bytes(b"not a pickle")
    else:
        C.shared_json_path(copy, "progress").write_text("{ torn")
    reads = []
    monkeypatch.setattr(storage, "load_tensors", lambda *a, **kw: reads.append(a))
    with pytest.raises(CheckpointError):
        saver.read(copy, {"model": None}, json=("progress",))
    assert reads == []
