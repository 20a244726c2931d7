"""``veoptim.export``'s public calls in one process: an export of a checkpoint holds its
weights bitwise, everything checkable is refused before an export directory exists, a
failed or interrupted export leaves the previous one published, and ``open_checkpoint``
reads only what every task shares and refuses what is not a training checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import veoptim.export.registry as registry
from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint import resolve, storage
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.component import TensorSpec, shared_json_path
from veoptim.checkpoint.layout import MANIFEST_FILE, VERSIONS_DIR
from veoptim.checkpoint.publish import Publisher
from veoptim.errors import CheckpointError, ConfigError
from veoptim.export import (
    FORMATS,
    ExportOptions,
    check_format,
    export_checkpoint,
    model_inventory,
    open_checkpoint,
    read_model_tensors,
    write_hf,
)
from veoptim.export.hf_format import (
    KIND_HF_EXPORT,
    MODEL_RECORD_FILE,
    SAFETENSORS_FILE,
    export_dtype,
    write_hf_export,
)
from veoptim.state import CONFIG

RUN = "run_0123456789ab"
PRESERVE = ExportOptions(dtype="preserve")


@dataclasses.dataclass
class Saved:
    checkpoint: Path  # <root>/final, a published name
    weights: dict[str, torch.Tensor]  # the model state it holds


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    base = tmp_path_factory.mktemp("export_api")
    trainer = build_trainer(base / "run", ["train.max_steps=1"])
    checkpointer = Checkpointer(base / "checkpoints", fsync=False)
    checkpointer.run = RUN
    save_with(checkpointer, trainer, "final")
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return Saved(base / "checkpoints" / "final", weights)


def export(saved: Saved, out: Path, name: str = "hf", **kwargs):
    return export_checkpoint(saved.checkpoint, out, name, fsync=False, **kwargs)


def versions(out: Path) -> list[str]:
    folder = out / VERSIONS_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# ---------------------------------------------------------------- round trip
def test_a_preserve_export_holds_the_checkpoint_weights_bitwise(saved, tmp_path):
    published = export(saved, tmp_path / "out", options=PRESERVE)

    assert published.path == resolve(tmp_path / "out", "hf")
    assert published.manifest.kind == KIND_HF_EXPORT
    assert (published.manifest.step, published.manifest.run) == (0, RUN)
    exported = load_file(published.path / SAFETENSORS_FILE)
    assert sorted(exported) == sorted(saved.weights)
    for key, tensor in saved.weights.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    record = json.loads((published.path / MODEL_RECORD_FILE).read_text())
    assert set(record) == {"content"} and record["content"]


def test_an_fp32_export_casts_the_bf16_weights_and_consumes_the_source_state(saved, tmp_path):
    source = open_checkpoint(saved.checkpoint)
    state = read_model_tensors(source, model_inventory(source))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}  # the run's weights
    write_hf_export(state, source.model, source.tokenizer, tmp_path / "hf", dtype="fp32")
    assert state == {}  # emptied tensor by tensor: the host never holds two models
    exported = load_file(tmp_path / "hf" / SAFETENSORS_FILE)
    assert {t.dtype for t in exported.values()} == {torch.float32}
    for key, tensor in saved.weights.items():
        assert torch.equal(exported[key], tensor.to(torch.float32)), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"


def test_export_dtype_names_every_choice():
    assert export_dtype("preserve") is None and export_dtype("fp32") == torch.float32
    with pytest.raises(ConfigError) as info:
        export_dtype("fp8")
    assert (
        str(info.value)
        == "export.dtype must be one of ['bf16', 'fp16', 'fp32', 'preserve'], got 'fp8'."
    )


# ---------------------------------------------------------------- refusals before anything is written
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"options": ExportOptions(dtype="fp8")}, ConfigError, "export.dtype must be one of"),
        ({"fmt": "onnx"}, ConfigError, f"export format must be one of {list(FORMATS)}, got 'onnx'"),
        ({"fmt": "peft"}, CheckpointError, "is not a LoRA checkpoint (it has no adapter weights)"),
        ({"fmt": "merged"}, CheckpointError, "--format merged needs the checkpoint of a LoRA run"),
    ],
    ids=["dtype", "format", "peft of a full fine-tune", "merged of a full fine-tune"],
)
def test_what_can_be_checked_is_refused_before_the_export_directory_exists(
    saved, tmp_path, kwargs, error, message
):
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        export(saved, out, **kwargs)
    assert message in str(info.value)
    assert not out.exists()
    export(saved, out, options=PRESERVE)  # negative control: the same call, valid, publishes
    assert versions(out) and resolve(out, "hf") is not None


def test_a_lora_checkpoint_is_refused_as_a_full_model_naming_the_formats_that_fit(saved):
    source = open_checkpoint(saved.checkpoint)
    assert not source.has_lora and check_format(source, "hf") is write_hf
    lora = dataclasses.replace(
        source, saved={"model.layers.0.q_proj.lora_A.weight": TensorSpec((4, 8), torch.float32)}
    )
    assert lora.has_lora and check_format(lora, "peft") is registry.lookup("peft").write
    with pytest.raises(CheckpointError, match="is a LoRA checkpoint; export it with --format peft"):
        check_format(lora, "hf")


def test_read_model_tensors_refuses_another_inventory_before_reading(saved, monkeypatch):
    source = open_checkpoint(saved.checkpoint)
    expected = model_inventory(source)
    key = sorted(expected)[0]
    other = {**expected, key: TensorSpec((1, *expected[key].shape), expected[key].dtype)}
    reads = []
    monkeypatch.setattr(storage, "load_tensors", lambda *args, **kwargs: reads.append(args))
    with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) with another shape/dtype: {key}"):
        read_model_tensors(source, other)
    assert reads == []
    read_model_tensors(source, expected)  # negative control: the right inventory is read
    assert len(reads) == 1


# ---------------------------------------------------------------- failures keep the previous export
def test_a_failing_writer_leaves_the_previous_export_published(saved, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = export(saved, out, options=PRESERVE).path

    def failing(state, out_dir: Path, options) -> None:
        (out_dir / "half.safetensors").write_bytes(b"\0" * 16)
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(
        registry._REGISTRY, "hf", dataclasses.replace(registry.lookup("hf"), write=failing)
    )
    with pytest.raises(CheckpointError, match="No space left on device"):
        export(saved, out)
    assert resolve(out, "hf") == first
    assert not (first / "half.safetensors").exists()


def test_an_interrupted_export_is_removed_and_never_published(saved, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = export(saved, out, options=PRESERVE).path
    before = versions(out)

    def interrupted(state, out_dir: Path, options) -> None:
        (out_dir / "half.safetensors").write_bytes(b"\0" * 16)
        raise KeyboardInterrupt

    monkeypatch.setitem(
        registry._REGISTRY, "hf", dataclasses.replace(registry.lookup("hf"), write=interrupted)
    )
    with pytest.raises(KeyboardInterrupt):
        export(saved, out)
    assert resolve(out, "hf") == first
    assert versions(out) == before  # its directory is gone


# ---------------------------------------------------------------- opening a checkpoint
def copy_of(saved: Saved, tmp_path: Path, edit) -> Path:
    """The checkpoint published again (a manifest of its own) with its run config edited."""
    root = tmp_path / "edited"
    with Publisher(root, fsync=False).write("final") as out:
        for item in saved.checkpoint.resolve().iterdir():
            if item.name != MANIFEST_FILE:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        path = shared_json_path(out, CONFIG)
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return root / "final"


def test_a_config_with_keys_this_release_lacks_still_opens(saved, tmp_path):
    def add_keys(config: dict) -> None:
        config["dpo"] = {"beta": 0.1}  # a task's own section
        config["model"]["added_later"] = 1  # a key of a newer release

    original = open_checkpoint(saved.checkpoint)
    edited = open_checkpoint(copy_of(saved, tmp_path, add_keys))
    assert edited.cfg == original.cfg
    assert edited.saved == original.saved and edited.step == original.step


def test_a_config_that_is_not_a_run_config_is_refused(saved, tmp_path):
    def break_it(config: dict) -> None:
        config["model"]["hidden_size"] = "big"

    copy = copy_of(saved, tmp_path, break_it)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(copy)
    where = shared_json_path(copy.resolve(), CONFIG)
    assert str(info.value).startswith(f"{where} is not a valid run config:")


def test_a_file_edited_after_publication_is_refused_by_its_manifest(saved, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(saved.checkpoint.resolve(), copy)  # the manifest comes along
    path = shared_json_path(copy, CONFIG)
    path.write_text(path.read_text() + " ")
    with pytest.raises(CheckpointError, match=r"config\.json has \d+ bytes, its manifest says"):
        open_checkpoint(copy)


def test_an_export_is_not_a_checkpoint_whether_named_or_a_directory(saved, tmp_path):
    out = tmp_path / "out"
    published = export(saved, out, options=PRESERVE)
    for path in (out / "hf", published.path):
        with pytest.raises(CheckpointError) as info:
            open_checkpoint(path)
        assert str(info.value) == (
            f"{published.path} is a Hugging Face model directory, not a training checkpoint."
        )
