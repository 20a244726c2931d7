"""The recipes under ``configs/recipes/``, composed exactly as ``python -m tasks.<task>
--config-name recipes/<name>`` composes them (no launcher, no hardware)."""

from __future__ import annotations

import importlib
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from tasks.compose import CONFIG_DIR

RECIPE_DIR = CONFIG_DIR / "recipes"
#: ``<hardware>_<task>_16rank[_<variant>].yaml``; every file is a recipe except the overlays.
RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
TASKS = ("sft", "dpo")
HARDWARE = {"ascend": ("npu", "hccl"), "cuda": ("cuda", "nccl")}

#: The scaled-down CPU run documented in every recipe (configs/recipes/scale/cpu_smoke.yaml).
CPU_SMOKE = "recipes/scale=cpu_smoke"
SMOKE_RANKS = 2
TINY_MOE_EXPERTS = 4  # configs/model/tiny_moe.yaml

#: The model of the 16-rank recipes: Qwen3-30B-A3B (config.json of the Hugging Face release).
QWEN3_30B_A3B = {"num_experts": 128, "max_position_embeddings": 40960}
WORLD = 16
PLACEHOLDER_PATH = "model.path=/models/Qwen3-30B-A3B"


def task_of(recipe: str) -> str:
    """``sft`` or ``dpo``, from the recipe's name (``cuda_dpo_16rank_offload`` -> ``dpo``)."""
    task = recipe.split("_")[1]
    assert task in TASKS, f"{recipe}: expected <hardware>_<task>_16rank[_variant]"
    return task


def hardware_of(recipe: str) -> str:
    hardware = recipe.split("_")[0]
    assert hardware in HARDWARE, f"{recipe}: expected <hardware>_<task>_16rank[_variant]"
    return hardware


def compose_recipe(
    recipe: str, overrides: list[str] | None = None, *, hydra: bool = False
) -> DictConfig:
    """``configs/recipes/<recipe>.yaml`` with overrides, over its task's registered schema
    (``hydra=True``: with the ``hydra`` node a ``python -m tasks.<task>`` run has)."""
    importlib.import_module(f"tasks.{task_of(recipe)}")  # registers <task>_schema
    job = task_of(recipe)  # what hydra.main names the job of python -m tasks.<task>
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=job):
        return compose(
            config_name=f"recipes/{recipe}", overrides=overrides or [], return_hydra_config=hydra
        )


def flat(cfg: DictConfig) -> dict[str, object]:
    """Every leaf of the resolved config as ``{dotted key: value}``."""
    out: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def differing_keys(a: DictConfig, b: DictConfig) -> set[str]:
    """Dotted keys whose resolved values differ between two composed configs."""
    fa, fb = flat(a), flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def smoke_overrides(run_dir: Path, *extra: str) -> list[str]:
    """The documented scaled-down CPU run, into ``run_dir``."""
    return [CPU_SMOKE, f"run.dir={run_dir}", *extra]
