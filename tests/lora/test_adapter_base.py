"""An exported adapter keeps its base: ``base_model_name_or_path`` names a path that stays
valid while the base is published (the export's name link, never the version directory
behind it, which retention deletes when the base is published again), and the base's
fingerprint beside the adapter tells a later load whether that base is still the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from peft import AutoPeftModelForCausalLM

from callbacks import standard_callbacks
from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import build_trainer
from tests.lora.helpers import logits
from veoptim.errors import CheckpointError
from veoptim.lora.peft_format import BASE_FINGERPRINT_FILE, check_adapter_base

FP32 = ["model.dtype=fp32", "export.hf=true", "export.dtype=fp32", "train.max_steps=2"]
LORA = ["lora.enabled=true", "lora.r=4", "model=hf_local"]


def _run(run_dir: Path, overrides: list[str]):
    trainer = build_trainer(run_dir, [*FP32, *overrides])
    trainer.callbacks.callbacks = standard_callbacks(trainer.cfg, {})
    trainer.train()
    return trainer.model.eval()


@pytest.fixture(scope="module")
def adapter_on_an_export(tmp_path_factory):
    """A full fine-tune publishes ``exports/hf_final``; a LoRA run trains on it."""
    root = tmp_path_factory.mktemp("adapter_base")
    base_run = root / "base"
    _run(base_run, [])
    hf_final = base_run / "exports" / "hf_final"
    model = _run(root / "lora", [*LORA, f"model.path={hf_final}"])
    return base_run, hf_final, root / "lora" / "exports" / "lora_final", model


def test_the_adapter_loads_in_plain_peft_after_its_base_is_republished_twice(
    adapter_on_an_export, tmp_path
):
    base_run, hf_final, adapter, model = adapter_on_an_export
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_final.absolute())  # the name link
    # The offline CLI writes the same reference.
    argv = [str(base_run.parent / "lora" / "checkpoints" / "step_00000002"), "--out",
            str(tmp_path / "cli"), "--name", "lora", "--format", "peft", "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    cli = json.loads((tmp_path / "cli" / "lora" / "adapter_config.json").read_text())
    assert cli["base_model_name_or_path"] == str(hf_final.absolute())
    first_version = hf_final.resolve()
    for _ in range(2):  # `make demo` twice: the base run repeated in its run dir
        _run(base_run, ["checkpoint.overwrite=true"])
    assert not first_version.exists(), "retention should have removed the old version"
    assert hf_final.resolve() != first_version
    for directory in (adapter, tmp_path / "cli" / "lora"):
        peft_model = AutoPeftModelForCausalLM.from_pretrained(str(directory)).eval()
        assert (logits(peft_model) - logits(model)).abs().max() <= 1e-5
        assert check_adapter_base(directory) == hf_final.absolute()


def test_a_different_base_under_the_same_name_is_detected(adapter_on_an_export, tmp_path):
    _, hf_final, adapter, _ = adapter_on_an_export
    other = tmp_path / "other"
    _run(other, ["model.num_hidden_layers=1"])
    with pytest.raises(CheckpointError, match="not the one the adapter .* was trained on"):
        check_adapter_base(adapter, other / "exports" / "hf_final")
    assert check_adapter_base(adapter, hf_final) == hf_final


def test_a_base_built_from_config_is_checked_by_its_exported_fingerprint(tmp_path):
    _run(tmp_path / "run", ["lora.enabled=true", "lora.r=4"])
    base = tmp_path / "run" / "exports" / "hf_base"
    adapter = shutil.copytree(tmp_path / "run" / "exports" / "lora_final", tmp_path / "adapter")
    assert "init_seed" in json.loads((adapter / BASE_FINGERPRINT_FILE).read_text())
    assert check_adapter_base(adapter) == base.absolute()
    # The run repeated with another base: hf_base is published again, holding that base.
    _run(tmp_path / "run", ["lora.enabled=true", "lora.r=4", "model.init_seed=7",
                            "checkpoint.overwrite=true"])  # fmt: skip
    with pytest.raises(CheckpointError, match="init_seed differs"):
        check_adapter_base(adapter)


def test_an_adapter_on_a_hub_model_names_the_id_and_its_commit(tmp_path, monkeypatch):
    from tests.config.test_hub_model import REPO_ID, put_in_hub_cache
    from tests.config.test_model_path import _model_dir

    cache = tmp_path / "hub"
    commit = put_in_hub_cache(cache, REPO_ID, _model_dir(tmp_path / "src", extra_tokens=False))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = _run(tmp_path / "lora", ["lora.enabled=true", "lora.r=4", f"model.path={REPO_ID}"])
    adapter = tmp_path / "lora" / "exports" / "lora_final"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (REPO_ID, commit)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), cache_dir=str(cache))
    assert (logits(peft_model.eval()) - logits(model)).abs().max() <= 1e-5
    assert check_adapter_base(adapter).name == commit
