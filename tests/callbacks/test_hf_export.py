"""Hugging Face export: transformers loads it and reproduces the trained model's logits;
files are world-readable; the cadence; the offline CLI writes the same files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from callbacks.hf_export import EXPORTS_SUBDIR, HF_EXPORT_NAME, HFExportCallback, hf_step_name
from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import read_manifest
from veoptim.export.hf_format import (
    GENERATION_CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = build_trainer(
        tmp_path_factory.mktemp("hf"), ["model.dtype=fp32", "train.max_steps=2"]
    )
    trainer.train()
    return trainer


def _export(trainer, dtype: str, shard_mb: int = 2048):
    trainer.cfg.export.dtype = dtype
    trainer.cfg.export.max_shard_size_mb = shard_mb
    HFExportCallback(trainer.cfg.export, fsync=False).on_train_end(trainer)
    return resolve(trainer.run_dir / EXPORTS_SUBDIR, HF_EXPORT_NAME)


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("What is 12+30?", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("dtype", ["fp32", "preserve"])
def test_export_reproduces_logits_exactly(trained, dtype):
    path = _export(trained, dtype)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trained.model.eval()
    assert torch.equal(_logits(loaded, tokenizer), _logits(trained.model, tokenizer))


def test_bf16_export_is_bf16_and_close(trained):
    path = _export(trained, "bf16")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.testing.assert_close(
        _logits(loaded, tokenizer).float(), _logits(trained.model, tokenizer), atol=0.1, rtol=0.05
    )


def test_large_export_is_sharded_with_an_index(trained):
    path = _export(trained, "fp32", shard_mb=0)  # every tensor its own shard
    index = json.loads((path / SAFETENSORS_INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert torch.equal(_logits(loaded, tokenizer), _logits(trained.model, tokenizer))


def test_unfinished_run_writes_no_export(tmp_path):
    trainer = build_trainer(tmp_path, ["train.stop_at_step=1"])
    trainer.train()
    HFExportCallback(trainer.cfg.export).on_train_end(trainer)
    assert not (trainer.run_dir / EXPORTS_SUBDIR).exists()


def test_offline_export_of_a_training_checkpoint_matches_the_live_export(trained, tmp_path):
    root = tmp_path / "checkpoints"
    save_with(Checkpointer(root, fsync=False), trained, "final")
    out = tmp_path / "exports"
    argv = [str(root / "final"), "--out", str(out), "--name", "offline", "--dtype", "fp32"]
    assert export_main(argv) == 0
    offline = AutoModelForCausalLM.from_pretrained(resolve(out, "offline"))
    tokenizer = AutoTokenizer.from_pretrained(resolve(out, "offline"))
    trained.model.eval()
    assert torch.equal(_logits(offline, tokenizer), _logits(trained.model, tokenizer))


def test_offline_export_rejects_a_non_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--name", "x"]) == 2
    assert "checkpoint.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "o" / "x").exists()


def test_every_exported_file_is_world_readable(trained):
    """safetensors writes a 0600 temporary file and renames it; the export fixes the mode."""
    old = os.umask(0o022)
    try:
        path = _export(trained, "fp32", shard_mb=0)
    finally:
        os.umask(old)
    files = [p for p in path.rglob("*") if p.is_file()]
    assert {SAFETENSORS_INDEX_FILE, "config.json", GENERATION_CONFIG_FILE} <= {
        p.name for p in files
    }
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: "0o644" for p in files
    }


def test_generation_config_carries_the_tokenizer_special_ids(trained):
    path = _export(trained, "bf16")
    generation = GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == trained.tokenizer.eos_token_id
    assert generation.pad_token_id == trained.tokenizer.pad_token_id
    assert generation.bos_token_id == trained.tokenizer.bos_token_id


def test_tied_weights_are_stored_once_and_reload_exactly(tmp_path):
    trainer = build_trainer(
        tmp_path, ["model.dtype=fp32", "model.tie_word_embeddings=true", "train.max_steps=1"]
    )
    trainer.train()
    path = _export(trainer, "fp32")
    with safe_open(path / SAFETENSORS_FILE, "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    trainer.model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert torch.equal(_logits(loaded, tokenizer), _logits(trainer.model, tokenizer))


def test_cadence_exports_hf_step_names_and_hf_final(tmp_path):
    trainer = build_trainer(tmp_path, ["train.max_steps=3", "export.every_steps=2"])
    callback = HFExportCallback(trainer.cfg.export, fsync=False)
    trainer.callbacks.callbacks.append(callback)
    trainer.train()
    root = trainer.run_dir / EXPORTS_SUBDIR
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert names == [HF_EXPORT_NAME, hf_step_name(2)] == ["hf_final", "hf_step_00000002"]
    for name, step in ((hf_step_name(2), 2), (HF_EXPORT_NAME, 3)):
        manifest = read_manifest(resolve(root, name))
        assert (manifest.kind, manifest.step, manifest.prunable) == ("hf_export", step, False)
        AutoModelForCausalLM.from_pretrained(resolve(root, name))


def test_export_continues_as_model_path_of_a_new_run(trained, tmp_path):
    """`model=hf_local model.path=<export>`: the new run starts from the exported weights
    (with the exported tokenizer), and builds the same structure on meta for ranks > 0."""
    path = _export(trained, "fp32")
    run = build_trainer(
        tmp_path,
        ["model=hf_local", f"model.path={path}", f"data.tokenizer_path={path}", "model.dtype=fp32"],
    )
    exported = dict(trained.model.named_parameters())
    for name, param in run.model.named_parameters():
        assert torch.equal(param.detach(), exported[name].detach()), name
    from veoptim.models import build_model

    meta = build_model(run.cfg.model, len(run.tokenizer), on_meta=True)
    shapes = {n: (p.shape, p.dtype) for n, p in meta.named_parameters()}
    assert all(p.is_meta for p in meta.parameters())
    assert shapes == {n: (p.shape, p.dtype) for n, p in run.model.named_parameters()}
