"""Every recipe under configs/recipes/ composed and validated for 16 ranks without hardware:
mesh sizes, expert divisibility, batch divisibility, the required model.path, the claims of
the recipes' comments (variants differ only where they say), overrides on top of a recipe,
and the scaled-down CPU overlay."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, run_sft_cli
from tests.recipes.helpers import (
    CPU_SMOKE,
    HARDWARE,
    PLACEHOLDER_PATH,
    QWEN3_30B_A3B,
    RECIPES,
    SMOKE_RANKS,
    TASKS,
    TINY_MOE_EXPERTS,
    WORLD,
    compose_recipe,
    differing_keys,
    hardware_of,
    task_of,
)
from veoptim.config import to_config
from veoptim.config.launch import check_launch, min_world_size
from veoptim.data.sampler import GlobalBatchSampler
from veoptim.distributed.sizes import resolve_parallel_sizes
from veoptim.errors import ConfigError
from veoptim.objectives import DPOConfig, SFTConfig

pytestmark = pytest.mark.slow

SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig}
BASES = [r for r in RECIPES if not r.endswith("_offload")]
DPO = [r for r in RECIPES if task_of(r) == "dpo"]


def load(recipe: str, *overrides: str):
    """The validated config of a recipe, with a placeholder model.path (set or not)."""
    return to_config(compose_recipe(recipe, [PLACEHOLDER_PATH, *overrides]), resolve_model=False)


def check_batches(train, dp_size: int) -> int:
    """What every rank's sampler checks at startup; returns the accumulation steps."""
    assert train.global_batch_size % (dp_size * train.micro_batch_size) == 0
    for rank in range(dp_size):
        GlobalBatchSampler(
            num_examples=train.global_batch_size * 10,
            global_batch_size=train.global_batch_size,
            micro_batch_size=train.micro_batch_size,
            dp_rank=rank,
            dp_size=dp_size,
            seed=train.seed,
        )
    return train.global_batch_size // (dp_size * train.micro_batch_size)


def test_the_recipe_set():
    """Ascend and CUDA, SFT and DPO, each with its cpu_offload_adamw variant."""
    variants = ("", "_offload")
    expected = {f"{hw}_{t}_16rank{v}" for hw in HARDWARE for t in TASKS for v in variants}
    assert set(RECIPES) == expected


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_against_16_ranks(recipe):
    cfg = load(recipe)
    assert type(cfg) is SCHEMAS[task_of(recipe)]
    device, backend = HARDWARE[hardware_of(recipe)]
    assert (cfg.run.device, cfg.parallel.backend) == (device, backend)
    assert (cfg.run.dir, cfg.run.name) == (f"runs/{recipe}", recipe)
    assert (cfg.model.name, cfg.model.dtype) == ("hf_local", "bf16")
    # mesh: FSDP2 over 16 ranks, experts split over ep=8 and FSDP-sharded over efsdp=2
    experts = QWEN3_30B_A3B["num_experts"]
    sizes = resolve_parallel_sizes(cfg.parallel, WORLD, experts)
    assert (sizes.world, sizes.dp_replicate, sizes.dp_shard, sizes.ep, sizes.efsdp) == (
        16, 1, 16, 8, 2,
    )  # fmt: skip
    assert experts % sizes.ep == 0 and (experts // sizes.ep) % sizes.efsdp == 0
    assert min_world_size(cfg.parallel) == WORLD
    check_launch(cfg.parallel, WORLD)
    with pytest.raises(ConfigError, match="needs 16 processes"):
        check_launch(cfg.parallel, 1)
    # an ep group is `ep` consecutive ranks: inside one node of 16 and one node of 8
    assert all(per_node % sizes.ep == 0 for per_node in (16, 8))
    # batches: every rank reads its own data (plan.dp_size is the world size)
    assert check_batches(cfg.train, sizes.world) >= 1
    assert cfg.data.max_seq_len <= QWEN3_30B_A3B["max_position_embeddings"]
    # a complete experiment: data, schedule, checkpoint cadence, exports
    assert cfg.data.train_path.endswith(".jsonl")
    assert 0 < cfg.scheduler.warmup_steps < cfg.train.max_steps
    assert 0 < cfg.checkpoint.save_steps < cfg.train.max_steps and cfg.checkpoint.keep_last > 0
    assert cfg.export.hf and cfg.export.dtype == "bf16"
    assert 0 < cfg.export.every_steps < cfg.train.max_steps
    assert cfg.optim.lr < 1e-4 and cfg.train.grad_clip > 0


@pytest.mark.parametrize("recipe", BASES)
def test_a_model_whose_expert_count_ep_does_not_divide_is_refused(recipe):
    """Qwen1.5-MoE-A2.7B has 60 experts: ep=8 does not divide it (the startup check)."""
    cfg = load(recipe)
    with pytest.raises(ConfigError, match=r"ep=8 must divide the number of experts \(60\)"):
        resolve_parallel_sizes(cfg.parallel, WORLD, 60)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_unset_model_path_stops_with_the_message(recipe):
    overrides = [] if task_of(recipe) == "sft" else ["model.path="]
    with pytest.raises(ConfigError, match=r"model\.path is required with model=hf_local"):
        to_config(compose_recipe(recipe, overrides), resolve_model=False)


@pytest.mark.parametrize("recipe", DPO)
def test_dpo_starts_from_the_export_of_its_sft_recipe(recipe):
    dpo = to_config(compose_recipe(recipe), resolve_model=False)
    sft = load(recipe.replace("_dpo_", "_sft_"))
    assert dpo.model.path == f"{sft.run.dir}/exports/hf_final"
    assert (dpo.dpo.loss, dpo.dpo.beta, dpo.dpo.label_smoothing) == ("sigmoid", 0.1, 0.0)
    assert dpo.optim.lr < sft.optim.lr / 10
    assert dpo.optim.name == sft.optim.name


# The variants claim to be the same experiment; these keys are all that may differ.
OFFLOAD_KEYS = {
    "run.dir", "run.name", "model.path", "checkpoint.async_save", "optim.name",
    "optim.moment_dtype", "optim.cpu_offload_param_patterns",
}  # fmt: skip
HARDWARE_KEYS = {
    "run.dir", "run.name", "run.device", "parallel.backend", "optim.name", "optim.moment_dtype",
}  # fmt: skip


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.endswith("_offload")])
def test_an_offload_variant_is_its_base_recipe_with_host_optimizer_state(recipe):
    base = compose_recipe(recipe.removesuffix("_offload"), [PLACEHOLDER_PATH])
    assert differing_keys(base, compose_recipe(recipe, [PLACEHOLDER_PATH])) <= OFFLOAD_KEYS
    variant = load(recipe)
    assert variant.optim.name == "cpu_offload_adamw" and not variant.checkpoint.async_save
    assert (variant.optim.resident_moment_dtype, variant.optim.cpu_moment_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.startswith("ascend_")])
def test_ascend_and_cuda_recipes_are_the_same_experiment(recipe):
    cuda = recipe.replace("ascend_", "cuda_", 1)
    a, b = compose_recipe(recipe, [PLACEHOLDER_PATH]), compose_recipe(cuda, [PLACEHOLDER_PATH])
    assert differing_keys(a, b) <= HARDWARE_KEYS


def test_offload_patterns_select_exactly_the_routed_experts():
    """The pattern on a Qwen3-MoE model (the tiny one has the real module names)."""
    from veoptim.models.build import build_model

    tiny = to_config(compose_recipe("cuda_sft_16rank", [CPU_SMOKE])).model
    names = [n for n, _ in build_model(tiny, 512, on_meta=True).named_parameters()]
    for recipe in [r for r in RECIPES if r.endswith("_offload")]:
        patterns = load(recipe).optim.cpu_offload_param_patterns
        offloaded = {n for n in names if any(re.search(p, n) for p in patterns)}
        assert offloaded == {n for n in names if ".mlp.experts." in n}, recipe
        assert offloaded and not any(".mlp.gate." in n for n in offloaded)


def test_overrides_still_work_on_top_of_a_recipe():
    cfg = load(
        "cuda_sft_16rank",
        "optim=master_fp32_adamw",  # a group
        "optim.lr=2e-5",
        "train.max_steps=10",
        "parallel.ep=4",
        "data.max_seq_len=8192",
        "lora.enabled=true",
        "run.dir=/scratch/sft",
    )
    assert (cfg.optim.name, cfg.optim.lr) == ("master_fp32_adamw", 2e-5)
    assert cfg.optim.betas == [0.9, 0.95]  # the recipe's, on top of the new group
    assert (cfg.train.max_steps, cfg.parallel.ep, cfg.data.max_seq_len) == (10, 4, 8192)
    assert cfg.lora.enabled and cfg.run.dir == "/scratch/sft" and cfg.model.path
    assert resolve_parallel_sizes(cfg.parallel, WORLD, 128).efsdp == 4
    with pytest.raises(ConfigError, match=r"optim\.lrr.*did you mean optim\.lr\?"):
        load("cuda_sft_16rank", "+optim.lrr=1e-3")


SMOKE_KEYS = re.compile(
    r"run\.(dir|device)|model\..*|parallel\..*|data\.(train_path|tokenizer_path|max_seq_len)"
    r"|train\.(max_steps|global_batch_size|micro_batch_size)|scheduler\.warmup_steps"
    r"|checkpoint\.(save_steps|keep_last|overwrite)|export\.(every_steps|max_shard_size_mb)"
    r"|logging\..*"
)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_cpu_smoke_overlay_scales_the_recipe_down(recipe):
    smoke = compose_recipe(recipe, [CPU_SMOKE])
    cfg = to_config(smoke)
    assert (cfg.run.device, cfg.parallel.backend) == ("cpu", "gloo")
    assert cfg.run.dir == f"runs/smoke/{recipe}"
    assert (cfg.model.name, cfg.model.path, cfg.data.train_path) == ("tiny_moe", "", "")
    sizes = resolve_parallel_sizes(cfg.parallel, SMOKE_RANKS, TINY_MOE_EXPERTS)
    assert (sizes.dp_shard, sizes.ep, sizes.efsdp) == (2, 2, 1)
    with pytest.raises(ConfigError, match="needs 2 processes.*--nproc_per_node 2"):
        check_launch(cfg.parallel, 1)
    assert check_batches(cfg.train, SMOKE_RANKS) == 2
    assert 0 < cfg.checkpoint.save_steps < cfg.train.max_steps and cfg.export.hf
    assert 0 < cfg.export.every_steps < cfg.train.max_steps
    # everything else (task, optimizer type and patterns, dtype, dpo.*, async_save) is the recipe's
    changed = differing_keys(compose_recipe(recipe, [PLACEHOLDER_PATH]), smoke)
    assert all(SMOKE_KEYS.fullmatch(k) for k in changed), sorted(changed)
    assert "optim.name" not in changed and "model.dtype" not in changed


def test_a_recipe_in_one_process_suggests_a_working_torchrun_command(tmp_path):
    """``python -m tasks.sft --config-name recipes/... recipes/scale=cpu_smoke`` without
    torchrun stops with a torchrun command to copy; it must run the same recipe."""
    args = ["--config-name", "recipes/cuda_sft_16rank", CPU_SMOKE, f"run.dir={tmp_path / 'run'}"]
    proc = run_sft_cli(args, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    expected = (
        f"torchrun --standalone --nproc_per_node {SMOKE_RANKS} -m tasks.sft "
        f"--config-name recipes/cuda_sft_16rank {CPU_SMOKE}"
    )
    assert expected in output, output[-2000:]


def test_every_recipe_header_gives_its_launch_commands():
    for recipe in RECIPES:
        text = (REPO / "configs" / "recipes" / f"{recipe}.yaml").read_text()
        task = task_of(recipe)
        cli = f"-m tasks.{task} --config-name recipes/{recipe}"
        assert f"torchrun --standalone --nproc_per_node 16 {cli}" in text, recipe
        assert "torchrun --nnodes 2 --nproc_per_node 8 --node_rank $NODE_RANK" in text, recipe
        smoke = f"-m tasks.{task} \\\n#     --config-name recipes/{recipe} {CPU_SMOKE}"
        assert smoke in text, recipe


def test_docs_list_every_recipe():
    text = (REPO / "docs" / "recipes.md").read_text()
    for recipe in RECIPES:
        assert f"`{recipe}.yaml`" in text or f"recipes/{recipe}.yaml" in text, recipe
    assert CPU_SMOKE in text and "](ascend.md)" in text


def test_cli_recipe_without_model_path_exits_with_the_message(tmp_path):
    """``python -m tasks.sft --config-name recipes/...``: the real entry point."""
    proc = run_sft_cli(["--config-name", "recipes/cuda_sft_16rank"], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert "ConfigError: model.path is required with model=hf_local" in output
    assert "Traceback" not in output
