"""DPO runs end to end: preference accuracy rises from an SFT model (full fine-tuning and
LoRA), the reference never changes and is never saved, resume is bitwise on 1 and 2
ranks (FSDP2, and expert parallel with LoRA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.compose import compose_config, load_config
from tasks.runner import run_task
from tests.checkpoint.helpers import ckpt_io
from tests.checkpoint.helpers.sft_jobs import job_env
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import step_name
from veoptim.distributed import DistContext, init_distributed
from veoptim.trainer import Trainer

pytestmark = pytest.mark.slow

QUIET = ["run.device=cpu", "logging.progress=false", "logging.level=WARNING", "logging.log_every=1",
         "checkpoint.fsync=false"]  # fmt: skip
#: A DPO run of the bundled model built from config (mechanics only, a few steps).
TINY = [*QUIET, "model=tiny_dense", "model.path=", "export.hf=false", "train.global_batch_size=4",
        "train.micro_batch_size=2", "scheduler.warmup_steps=1", "optim.lr=1e-3"]  # fmt: skip
EVAL_PAIRS = 256


def dpo(run_dir: Path, *overrides: str, env: dict | None = None) -> dict:
    return run_task(compose_config("dpo", [f"run.dir={run_dir}", *overrides]), env=env or {})


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory) -> Path:
    """The bundled model after a short SFT run, exported (what DPO starts from)."""
    run_dir = tmp_path_factory.mktemp("sft")
    overrides = [f"run.dir={run_dir}", *QUIET, "train.max_steps=300", "scheduler.warmup_steps=10"]
    run_task(compose_config("sft", overrides), env={})
    return run_dir / "exports" / "hf_final"


def preference_accuracy(run_dir: Path, overrides: list[str]) -> float:
    """Share of the first EVAL_PAIRS bundled pairs whose implicit reward prefers the chosen
    answer, for the policy of the run's last checkpoint."""
    cfg = load_config("dpo", [f"run.dir={run_dir}", *overrides, "checkpoint.resume=auto"])
    trainer = Trainer.from_config(cfg, init_distributed("cpu", "gloo", {}), [])
    trainer.resume()
    trainer.model.eval()
    objective = trainer.objective
    wins = 0.0
    with torch.no_grad():
        for start in range(0, EVAL_PAIRS, 32):
            batch = objective.micro_batch(list(range(start, start + 32))).inputs
            wins += float(objective.loss(trainer.model, batch).metrics["rewards/accuracies"])
    return wins / EVAL_PAIRS


@pytest.mark.parametrize(
    "variant,overrides",
    [("full", ["optim.lr=5e-4"]), ("lora", ["lora.enabled=true", "optim.lr=5e-3"])],
)
def test_dpo_raises_preference_accuracy(sft_export, tmp_path, variant, overrides):
    run_overrides = [*QUIET, f"model.path={sft_export}", "train.max_steps=80", *overrides]
    result = dpo(tmp_path, *run_overrides)
    curve = metrics(tmp_path)
    assert curve[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at step 1
    assert result["final_loss"] < 0.55
    accuracy = preference_accuracy(tmp_path, run_overrides)
    print(f"{variant}: preference accuracy {accuracy:.3f} over {EVAL_PAIRS} pairs")
    assert accuracy > 0.7  # 0.5 is chance; measured 0.76 (full) and 0.75 (LoRA)
    export = tmp_path / "exports" / ("lora_final" if variant == "lora" else "hf_final")
    assert export.is_dir()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


MOE_LORA = ["model=tiny_moe", "lora.target_experts=[gate_up_proj,down_proj]"]


@pytest.mark.parametrize("lora,extra", [(False, []), (True, []), (True, MOE_LORA)])
def test_the_reference_never_changes_and_is_never_saved(tmp_path, lora, extra):
    overrides = [f"run.dir={tmp_path}", *TINY, "train.max_steps=3", f"lora.enabled={lora}", *extra]
    trainer = Trainer.from_config(
        load_config("dpo", overrides), init_distributed("cpu", "gloo", {}), []
    )
    batch = trainer.objective.micro_batch([0, 1, 2, 3]).inputs
    reference_before, _ = trainer.objective.reference_logps(trainer.model, batch)
    weights_before = _weights(trainer.objective.reference_model or trainer.model)
    policy_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    reference_after, _ = trainer.objective.reference_logps(trainer.model, batch)
    assert torch.equal(reference_before, reference_after)
    if lora:  # the base is the reference: its frozen weights are unchanged
        assert trainer.objective.reference_model is None
        after = _weights(trainer.model)
        frozen = [n for n in weights_before if ".lora_" not in n]
        assert frozen and all(torch.equal(weights_before[n], after[n]) for n in frozen)
    else:
        reference = trainer.objective.reference_model
        assert not any(p.requires_grad for p in reference.parameters())
        after = _weights(reference)
        assert all(torch.equal(weights_before[n], after[n]) for n in weights_before)
    changed = [
        n for n, p in trainer.model.named_parameters() if not torch.equal(p, policy_before[n])
    ]
    assert changed  # the policy did train
    trainer.save_checkpoint()
    saved = ckpt_io.read_checkpoint(tmp_path / "checkpoints" / step_name(3))
    assert not any("reference" in key for key in saved.tensors)
    assert sorted(json.loads((saved.path / "checkpoint.json").read_text())["components"]) == [
        "config", "lr_scheduler", "model", "optimizer", "progress", "rng", "run_ids", "sampler"
    ]  # fmt: skip


def assert_resume_bitwise(root: Path) -> None:
    straight = ckpt_io.read_checkpoint(root / "straight" / "checkpoints" / step_name(6))
    sliced = ckpt_io.read_checkpoint(root / "sliced" / "checkpoints" / step_name(6))
    assert ckpt_io.differences(straight, sliced) == []
    assert ckpt_io.metrics(root / "straight") == ckpt_io.metrics(root / "sliced")
    assert "rewards/margins" in metrics(root / "sliced")[-1]


def resume_pair(root: Path, overrides: list[str], env: dict | None = None) -> None:
    """6 steps straight; 3 steps, then a new trainer resuming to 6."""
    dpo(root / "straight", *overrides, "train.max_steps=6", env=env)
    dpo(root / "sliced", *overrides, "train.max_steps=6", "train.stop_at_step=3", env=env)
    dpo(root / "sliced", *overrides, "train.max_steps=6", "checkpoint.resume=auto", env=env)


def test_dpo_resume_is_bitwise_on_one_rank(tmp_path):
    resume_pair(tmp_path, [*TINY, "optim=master_fp32_adamw", "model.dtype=bf16"])
    assert_resume_bitwise(tmp_path)


TWO_RANK = {
    "fsdp_full": [*TINY, "parallel=fsdp", "optim=master_fp32_adamw", "model.dtype=bf16"],
    "ep_lora": [*TINY, "model=tiny_moe", "parallel=fsdp_ep2", "lora.enabled=true",
                "lora.target_experts=[gate_up_proj,down_proj]", "lora.target_modules=[q_proj]"],
}  # fmt: skip


def _two_rank_jobs(ctx: DistContext, out: Path) -> dict:
    for name, overrides in TWO_RANK.items():
        resume_pair(out / name, overrides, env=job_env(ctx))
    return {}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dpo2")
    run_ranks(2, _two_rank_jobs, out)
    return out


@pytest.mark.parametrize("name", sorted(TWO_RANK))
def test_dpo_resume_is_bitwise_on_two_ranks(two_ranks, name):
    assert_resume_bitwise(two_ranks / name)


def test_an_ipo_run_starts_at_its_closed_form_loss(tmp_path):
    """Policy == reference at step 1, so h = 0 and the IPO loss is (1 / (2 beta))^2."""
    beta = 0.5
    dpo(tmp_path, *TINY, "train.max_steps=2", "dpo.loss=ipo", f"dpo.beta={beta}")
    first = metrics(tmp_path)[0]
    assert first["loss"] == pytest.approx((1 / (2 * beta)) ** 2, rel=1e-6)
    assert first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
