"""``--help`` of the task commands: every config key with its type, default and meaning.

One subprocess per command shows the real entry point answers ``--help`` (Hydra would
otherwise print only its groups); the content is checked in-process on ``render_help``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tasks.cli import prog_name
from tasks.usage import config_name_of, render_help, short_type
from tests.conftest import REPO
from veoptim.config.reference import ConfigKey, config_keys, sections
from veoptim.objectives import DPOConfig, SFTConfig
from veoptim.slots import MultiLoRAConfig

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "multi_lora": MultiLoRAConfig}


def cli(task: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"tasks.{task}", *args],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip


def all_keys(schema: type) -> list[ConfigKey]:
    return [k for name, cls in sections(schema) for k in config_keys(cls, f"{name}.")]


@pytest.mark.parametrize(("task", "flag"), [("sft", "--help"), ("dpo", "-h")])
def test_help_lists_every_key_with_type_default_and_meaning(task, flag):
    proc = cli(task, flag)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"usage: python -m tasks.{task} ")
    assert "Config groups" in out and "Recipes" in out
    words = " ".join(out.split())  # the help texts are wrapped
    keys = all_keys(SCHEMAS[task])
    for k in keys:
        assert f"\n    {k.key}: {short_type(k.type)} = " in out, k.key
        assert f"{k.key}: " in words and " ".join(k.help.split()) in words, k.key
    names = {k.key for k in keys}
    assert {"train.max_steps", "optim.lr", "logging.progress"} <= names
    assert ("dpo.beta" in names) == (task == "dpo")


def test_hydra_help_is_still_hydras():
    proc = cli("sft", "--hydra-help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("Hydra (") and "--hydra-help" in proc.stdout


def test_defaults_are_the_task_configs_not_the_dataclasses():
    """dpo.yaml sets optim.lr=5e-4 and model=hf_local over the schema's 3e-3 and tiny_dense."""
    text = render_help("dpo", DPOConfig, "veoptim-dpo", "dpo")
    assert text.startswith("usage: veoptim-dpo ")
    assert "    optim.lr: float = 0.0005\n" in text
    assert "    run.dir: str = runs/dpo\n" in text
    assert "hf_local (default)" in text and "tiny_dense (default)" not in text


def test_groups_mark_each_default_option():
    text = render_help("sft", SFTConfig, "veoptim-sft", "sft")
    groups = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    assert "tiny_dense (default)" in groups["model"] and "tiny_moe" in groups["model"]
    assert "adamw (default)" in groups["optim"] and "master_fp32_adamw" in groups["optim"]
    assert "cosine (default)" in groups["scheduler"] and "single (default)" in groups["parallel"]


def test_recipes_are_those_of_the_task():
    sft = render_help("sft", SFTConfig, "veoptim-sft", "sft")
    dpo = render_help("dpo", DPOConfig, "veoptim-dpo", "dpo")
    assert "\n  cuda_sft_16rank\n" in sft and "\n  cuda_dpo_16rank\n" not in sft
    assert "\n  cuda_dpo_16rank\n" in dpo and "\n  cuda_sft_16rank\n" not in dpo
    assert "Qwen3-30B-A3B" in sft
    multi = render_help("multi_lora", MultiLoRAConfig, "veoptim-multi-lora", "multi_lora")
    assert "Recipes" not in multi and "    slots.seed: int = " in multi


def test_a_recipe_shows_its_own_defaults():
    argv = ["--config-name", "recipes/cuda_sft_16rank", "--help"]
    name = config_name_of(argv, "sft")
    assert name == "recipes/cuda_sft_16rank"
    assert config_name_of(["--config-name=recipes/x"], "sft") == "recipes/x"
    text = render_help("sft", SFTConfig, "veoptim-sft", name)
    assert "defaults of recipes/cuda_sft_16rank.yaml (--config-name)" in text
    assert "    run.dir: str = runs/cuda_sft_16rank\n" in text


def test_a_config_that_does_not_compose_is_one_line_and_exit_2():
    proc = cli("sft", "--config-name", "recipes/no_such_recipe", "--help")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: config 'recipes/no_such_recipe' does not compose: ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


def test_prog_is_the_installed_command_or_the_module():
    assert prog_name("sft", "/venv/bin/veoptim-sft") == "veoptim-sft"
    assert prog_name("multi_lora", "/venv/bin/veoptim-multi-lora") == "veoptim-multi-lora"
    assert prog_name("sft", "/repo/tasks/sft.py") == "python -m tasks.sft"
