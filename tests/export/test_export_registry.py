"""The export registry's public calls: lookup, the one-line refusals (an unknown format
naming the known ones, a LoRA-only format for a full checkpoint), the live format of a
run, and a new format added as one module plus one registry line, exported offline
(``veoptim-export``) and live through the same writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from callbacks.hf_export import EXPORTS_SUBDIR, live_state
from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import KIND_CHECKPOINT, read_manifest
from veoptim.errors import CheckpointError, ConfigError
from veoptim.export import (
    FORMATS,
    ExportFormat,
    ExportOptions,
    ModelState,
    check,
    export_checkpoint,
    lookup,
    names,
    publish_export,
    register,
    run_format,
    unregister,
)
from veoptim.export.hf_format import KIND_HF_EXPORT


# ---------------------------------------------------------------- the toy format: one module ...
def write_weights(state: ModelState, out_dir: Path, options: ExportOptions) -> None:
    """The model's state dict as one ``weights.pt`` (``torch.save``)."""
    weights = state.full_state()  # collective when live
    if state.is_main:
        torch.save(weights, out_dir / "weights.pt")


# ... plus one registry line
TOY = ExportFormat("torch", write_weights)


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)
    assert TOY.name not in names()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    trainer = build_trainer(
        tmp_path_factory.mktemp("registry"), ["model.dtype=fp32", "train.max_steps=1"]
    )
    trainer.train()
    return trainer


# ---------------------------------------------------------------- lookup and refusals
def test_lookup_gives_each_builtin_format_and_its_kind():
    assert names()[: len(FORMATS)] == FORMATS == ("hf", "peft", "merged", "dcp")
    assert lookup("hf").kind == KIND_HF_EXPORT and lookup("hf").needs_lora is False
    assert lookup("peft").needs_lora and lookup("merged").needs_lora
    dcp = lookup("dcp")
    assert dcp.kind == KIND_CHECKPOINT and dcp.copies_checkpoint


def test_an_unknown_format_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as info:
        lookup("onnx")
    assert str(info.value) == (
        "export format must be one of ['hf', 'peft', 'merged', 'dcp'], got 'onnx'."
    )


def test_a_lora_only_format_is_refused_for_a_full_checkpoint_in_one_line():
    for fmt in ("peft", "merged"):
        with pytest.raises(CheckpointError) as info:
            check(fmt, lora=False, origin="/ckpt/step_1")
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("/ckpt/step_1 is not a LoRA checkpoint")
        assert f"--format {fmt} needs the checkpoint of a LoRA run" in message
    with pytest.raises(CheckpointError, match="is a LoRA checkpoint; export it with --format peft"):
        check("hf", lora=True, origin="/ckpt/step_1")
    assert check("peft", lora=True, origin="x") is lookup("peft")  # negative control


def test_a_run_selects_its_format_by_lora_and_merge_lora(trainer):
    cfg = trainer.cfg
    assert run_format(cfg) == "hf"
    cfg.lora.enabled = True
    try:
        assert run_format(cfg) == "peft"
        cfg.export.merge_lora = True
        assert run_format(cfg) == "merged"
    finally:
        cfg.lora.enabled, cfg.export.merge_lora = False, False


def test_registering_a_taken_name_or_removing_a_builtin_is_refused(toy):
    assert names()[-1] == "torch"
    with pytest.raises(ConfigError, match="already registered"):
        register(toy)
    with pytest.raises(ConfigError, match="built in"):
        unregister("hf")


def test_a_checkpoint_copy_has_no_live_export(trainer, tmp_path):
    state = live_state(trainer, tmp_path, fsync=False)
    with pytest.raises(ConfigError, match="copies a checkpoint"):
        publish_export("dcp", state, tmp_path, "copy", ExportOptions())
    assert not tmp_path.joinpath("copy").exists()


# ---------------------------------------------------------------- a new format, offline and live
def test_a_registered_format_exports_offline_and_live_through_the_same_writer(
    toy, trainer, tmp_path
):
    expected = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path / "checkpoints", fsync=False)
    save_with(checkpointer, trainer, "final")
    checkpoint = tmp_path / "checkpoints" / "final"

    published = export_checkpoint(checkpoint, tmp_path / "out", "api", fmt="torch", fsync=False)
    argv = [str(checkpoint), "--out", str(tmp_path / "out"), "--name", "cli", "--format", "torch",
            "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    live_root = trainer.run_dir / EXPORTS_SUBDIR
    publish_export("torch", live_state(trainer, live_root, fsync=False), live_root, "torch_final",
                   ExportOptions())  # fmt: skip

    versions = [published.path, resolve(tmp_path / "out", "cli"), resolve(live_root, "torch_final")]
    for version in versions:
        weights = torch.load(version / "weights.pt", weights_only=True)
        assert weights.keys() == expected.keys(), version
        for key, tensor in expected.items():
            assert torch.equal(weights[key], tensor), (version, key)
        assert read_manifest(version).kind == KIND_HF_EXPORT
