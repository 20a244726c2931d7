"""LoRA exports: the PEFT adapter (with its base exported once beside it) and the merged
model, from the end-of-run callback and from ``veoptim-export``, byte for byte the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from callbacks import standard_callbacks
from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import build_trainer
from tests.lora.helpers import load_peft_strictly, logits
from veoptim.export.adapters import BASE_EXPORT

LORA = ["lora.enabled=true", "lora.r=4", "model.dtype=fp32", "export.hf=true", "export.dtype=fp32",
        "train.max_steps=3"]  # fmt: skip


def _run(run_dir: Path, extra: list[str] = ()):
    trainer = build_trainer(run_dir, [*LORA, *extra])
    trainer.callbacks.callbacks = standard_callbacks(trainer.cfg, {})
    trainer.train()
    return trainer.model.eval()


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_run")
    return run_dir, _run(run_dir)


def test_the_adapter_export_loads_in_peft_and_reproduces_the_model(adapter_run):
    run_dir, model = adapter_run
    exports = run_dir / "exports"
    config = json.loads((exports / "lora_final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((exports / BASE_EXPORT).absolute())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).eval()
    peft_model = load_peft_strictly(base, exports / "lora_final")
    assert (logits(peft_model) - logits(model)).abs().max() <= 1e-5
    assert (logits(base) - logits(model)).abs().max() > 1e-4


def test_the_cli_writes_the_same_files_as_the_callback(adapter_run, tmp_path):
    run_dir, model = adapter_run
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    out = tmp_path / "cli"
    argv = [str(checkpoint), "--out", str(out), "--name", "lora_final", "--format", "peft",
            "--dtype", "fp32", "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    ours, theirs = run_dir / "exports", out
    for name in (BASE_EXPORT, "lora_final"):
        files = sorted(p.name for p in (ours / name).iterdir())
        assert files == sorted(p.name for p in (theirs / name).iterdir()), name
        for file in files:
            a, b = (ours / name / file).read_bytes(), (theirs / name / file).read_bytes()
            if file == "adapter_config.json":  # each points to the base beside it
                a, b = json.loads(a), json.loads(b)
                assert b.pop("base_model_name_or_path") == str((out / BASE_EXPORT).absolute())
                a.pop("base_model_name_or_path")
            if file != "manifest.json":
                assert a == b, (name, file)


def test_merged_export_equals_the_adapter_applied_to_its_base(adapter_run, tmp_path):
    run_dir, model = adapter_run
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    argv = [str(checkpoint), "--out", str(tmp_path), "--name", "merged", "--format", "merged",
            "--dtype", "fp32", "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (logits(merged) - logits(model)).abs().max() <= 1e-5
    # The callback's merged export is the same file.
    callback_run = _run(tmp_path / "callback_merged", ["export.merge_lora=true"])
    assert (logits(callback_run) - logits(model)).abs().max() == 0  # same seed, same run
    a = (tmp_path / "callback_merged" / "exports" / "hf_final" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "merged" / "model.safetensors").read_bytes()


def test_a_full_model_export_of_a_lora_checkpoint_says_what_to_use(adapter_run, tmp_path, capsys):
    run_dir, _ = adapter_run
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert export_main([str(checkpoint), "--out", str(tmp_path), "--name", "x"]) == 2
    assert "--format peft" in capsys.readouterr().err
