"""Adapters are bound to their base's bytes: after the base run is repeated with other
values under the same name, a merged export, ``veoptim-generate --adapter`` and a LoRA
resume refuse it (naming both bases and the flag), and go on when the flag asks. Real
commands, real files."""

from __future__ import annotations

import json

import pytest

from tests import forkserver
from tests.conftest import REPO, run_sft_cli, run_task_cli
from veoptim.content_hash import files_content_hash
from veoptim.export.hf_format import MODEL_RECORD_FILE
from veoptim.lora.peft_format import BASE_FINGERPRINT_FILE

pytestmark = pytest.mark.slow

COMMON = ["run.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=2",
          "scheduler.warmup_steps=1", "logging.progress=false"]  # fmt: skip
ENV = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def ok(done) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def refused(done) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    return output


def module(name: str, *args: str):
    import os

    return forkserver.run_module(name, list(args), cwd=REPO, env={**os.environ, **ENV})


@pytest.fixture(scope="module")
def retrained(tmp_path_factory):
    """A base run, a LoRA slice on its hf_final with a PEFT export of step 2, then the base
    run repeated with another learning rate: the same name, shapes and config, other bytes."""
    root = tmp_path_factory.mktemp("base_content")
    base, lora = root / "base", root / "lora"
    ok(run_sft_cli([*COMMON, f"run.dir={base}", "train.max_steps=3"], REPO))
    hf_final = base / "exports" / "hf_final"
    first = files_content_hash(hf_final)
    ok(run_sft_cli([*COMMON, f"run.dir={lora}", "model=hf_local", f"model.path={hf_final}",
                    "lora.enabled=true", "train.max_steps=4", "train.stop_at_step=2"], REPO))  # fmt: skip
    checkpoint = lora / "checkpoints" / "step_00000002"
    ok(module("tasks.export", str(checkpoint), "--out", str(root / "out"), "--name", "adapter",
              "--format", "peft"))  # fmt: skip
    ok(run_sft_cli([*COMMON, f"run.dir={base}", "train.max_steps=3", "optim.lr=1e-2",
                    "checkpoint.overwrite=true"], REPO))  # fmt: skip
    assert files_content_hash(hf_final) != first  # retrained: other bytes under the same name
    return root, hf_final, lora, checkpoint, first


def test_exports_record_the_content_of_the_weights_they_wrote(retrained) -> None:
    root, hf_final, _, _, first = retrained
    record = json.loads((hf_final / MODEL_RECORD_FILE).read_text())
    assert record["content"] == files_content_hash(hf_final)
    adapter_base = json.loads((root / "out" / "adapter" / BASE_FINGERPRINT_FILE).read_text())
    assert adapter_base["content"] == first and adapter_base["path"] == str(hf_final.absolute())


def test_a_merged_export_onto_the_retrained_base_is_refused_unless_asked(retrained) -> None:
    root, hf_final, _, checkpoint, first = retrained
    args = [str(checkpoint), "--out", str(root / "merged"), "--name", "m", "--format", "merged"]
    message = refused(module("tasks.export", *args))
    assert "trained on another base model (content differs)" in message
    assert f"content {first[:12]}" in message and str(hf_final.absolute()) in message
    assert "--allow-other-base" in message and not (root / "merged" / "m").exists()
    output = ok(module("tasks.export", *args, "--allow-other-base"))
    assert "going on as --allow-other-base asks" in output
    assert (root / "merged" / "m" / "model.safetensors").is_file()


def test_generate_with_the_adapter_on_the_retrained_base_is_refused_unless_asked(
    retrained,
) -> None:
    root, hf_final, _, _, _ = retrained
    args = [str(hf_final), "--adapter", str(root / "out" / "adapter"), "--prompt", "1+1",
            "--max-new-tokens", "2"]  # fmt: skip
    message = refused(module("tasks.generate", *args))
    assert "is not the one the adapter" in message and "--allow-other-base" in message
    ok(module("tasks.generate", *args, "--allow-other-base"))


def test_a_lora_resume_on_the_retrained_base_is_refused_unless_asked(retrained) -> None:
    _, hf_final, lora, _, _ = retrained
    args = [*COMMON, f"run.dir={lora}", "model=hf_local", f"model.path={hf_final}",
            "lora.enabled=true", "train.max_steps=4", "checkpoint.resume=auto"]  # fmt: skip
    message = refused(run_task_cli("sft", args, REPO))
    assert "lora.allow_other_base=true" in message and "content differs" in message
    output = ok(run_task_cli("sft", [*args, "lora.allow_other_base=true"], REPO))
    assert "(step 2" in output
