"""Every recipe, scaled down with its documented override (recipes/scale=cpu_smoke), trains on
2 gloo ranks (FSDP2 x EP=2, the bundled tiny MoE and data) and writes checkpoints and Hugging
Face exports; an SFT smoke's export then starts a DPO smoke (the recipes' workflow).

Process start dominates, so one spawn of 2 ranks runs every recipe in turn (``run_task`` on
the spawn's process group); one more test runs the documented torchrun command itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tasks.runner import run_task
from tests.conftest import REPO
from tests.distributed.spawn import rank_env, run_ranks
from tests.recipes.helpers import CPU_SMOKE, RECIPES, compose_recipe, smoke_overrides, task_of
from veoptim.config import to_config

pytestmark = pytest.mark.slow

STEPS = 4  # configs/recipes/scale/cpu_smoke.yaml: save and export every 2 steps
CHAINED = "cuda_dpo_16rank_from_sft_export"  # DPO smoke from the cuda_sft_16rank smoke's export


def _run_all(ctx, out: Path, runs: list) -> dict:
    env = rank_env(ctx.rank, ctx.world_size, port=0)  # the group exists: the task joins it
    results = {}
    for key, cfg in runs:
        start = time.perf_counter()
        summary = run_task(cfg, env=env)
        results[key] = {**summary, "seconds": round(time.perf_counter() - start, 2)}
    return results


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("recipes")
    runs = [(r, compose_recipe(r, smoke_overrides(out / r))) for r in RECIPES]
    sft_export = out / "cuda_sft_16rank" / "exports" / "hf_final"
    chained = smoke_overrides(out / CHAINED, "model=hf_local", f"model.path={sft_export}")
    runs.append((CHAINED, compose_recipe("cuda_dpo_16rank", chained)))
    return out, run_ranks(2, _run_all, out / "spawn", runs)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run(run_dir: Path, task: str) -> dict:
    """Steps logged, checkpoints kept, exports published; returns the resolved config."""
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    if task == "dpo":  # the policy starts as its reference: the first loss is exactly ln 2
        assert abs(records[0]["loss"] - math.log(2)) < 1e-4, records[0]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [
        "step_00000002", "step_00000004",
    ]  # fmt: skip
    info = json.loads((ckpts / "step_00000004" / "checkpoint.json").read_text())
    assert (info["step"], info["world_size"]) == (STEPS, 2)
    exports = run_dir / "exports"
    for name in ("hf_step_00000002", "hf_final"):
        config = json.loads((exports / name / "config.json").read_text())
        experts = config.get("num_local_experts", config.get("num_experts"))
        assert (config["model_type"], experts) == ("qwen3_moe", 4), name
        assert list((exports / name).glob("*.safetensors")), name
    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_scaled_down_on_two_gloo_ranks(smoke, recipe):
    out, results = smoke
    resolved = check_run(out / recipe, task_of(recipe))
    assert resolved["run"]["device"] == "cpu" and resolved["model"]["name"] == "tiny_moe"
    assert resolved["parallel"]["ep"] == 2
    expected_optim = compose_recipe(recipe).optim.name  # the recipe's optimizer type
    assert resolved["optim"]["name"] == expected_optim
    assert results[recipe]["seconds"] > 0


def test_dpo_smoke_starts_from_the_sft_smoke_export(smoke):
    """SFT -> hf_final -> DPO (model.path) -> hf_final, loadable by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, results = smoke
    resolved = check_run(out / CHAINED, "dpo")
    sft_export = out / "cuda_sft_16rank" / "exports" / "hf_final"
    assert resolved["model"] == {**resolved["model"], "name": "hf_local", "path": str(sft_export)}
    final = out / CHAINED / "exports" / "hf_final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
    print({k: v["seconds"] for k, v in results.items()})  # shown with pytest -s


def test_documented_torchrun_smoke_command(tmp_path):
    """The header's command as a user types it (plus a run.dir), through tasks.dpo."""
    recipe = "ascend_dpo_16rank_offload"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tasks.dpo", "--config-name", f"recipes/{recipe}", CPU_SMOKE]
    cmd += [f"run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "on cpu x2" in log and "optim=cpu_offload_adamw" in log
    check_run(tmp_path / "run", "dpo")


def test_meta_ranks_build_the_buffers_rank_0_loads(tmp_path):
    """What the recipes need on 16 ranks: the same buffer dtypes on rank 0 and the others."""
    from veoptim.models.build import build_model

    tiny = to_config(compose_recipe("cuda_sft_16rank", [CPU_SMOKE])).model  # bf16
    build_model(tiny, 512).save_pretrained(tmp_path / "model")
    cfg = replace(tiny, name="hf_local", path=str(tmp_path / "model"))
    rank0 = {n: b.dtype for n, b in build_model(cfg, 512).named_buffers()}
    others = {n: b.dtype for n, b in build_model(cfg, 512, on_meta=True).named_buffers()}
    assert rank0 == others
