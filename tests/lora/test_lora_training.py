"""LoRA through the real Trainer: the base stays frozen, adapters train with FP32 masters,
checkpoints hold only the adapters (and their base's fingerprint), resume bitwise on 1
and 2 ranks, and are refused against another base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.checkpoint.helpers.ckpt_io import read_checkpoint
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.errors import CheckpointError
from veoptim.optim import MASTER_WEIGHT

pytestmark = pytest.mark.slow

LORA = ["lora.enabled=true", "lora.r=4", "optim=master_fp32_adamw", "model.dtype=bf16"]


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path):
    trainer = build_trainer(tmp_path, LORA)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                   if not p.requires_grad}  # fmt: skip
    held = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert held and all(".lora_" in names[id(p)] for p in held)
    for _ in range(3):
        trainer.train_step()
    for name, param in trainer.model.named_parameters():
        if name in base_before:
            assert torch.equal(param, base_before[name]), f"frozen {name} changed"
    lora_b = [p for n, p in trainer.model.named_parameters() if ".lora_B." in n]
    assert all(torch.count_nonzero(p) > 0 for p in lora_b)
    assert all(trainer.optimizer.state[p][MASTER_WEIGHT].dtype == torch.float32 for p in held)


def test_a_lora_checkpoint_holds_adapters_only_and_is_small(tmp_path):
    full = build_trainer(tmp_path / "full", ["optim=master_fp32_adamw", "model.dtype=bf16"])
    lora = build_trainer(tmp_path / "lora", LORA)
    for trainer in (full, lora):
        trainer.train_step()
        save_with(Checkpointer(tmp_path / "ckpt", fsync=False), trainer, trainer.run_dir.name)
    saved = read_checkpoint(tmp_path / "ckpt" / "lora").tensors
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    ratio = _dir_bytes(resolve(tmp_path / "ckpt", "lora")) / _dir_bytes(
        resolve(tmp_path / "ckpt", "full")
    )
    assert ratio < 0.3, ratio


def test_lora_resumes_bitwise(tmp_path):
    straight = build_trainer(tmp_path / "straight", LORA)
    for _ in range(4):
        straight.train_step()
    first = build_trainer(tmp_path / "first", LORA)
    first.train_step()
    first.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), first, "s2")
    resumed = build_trainer(tmp_path / "resumed", LORA)
    load_with(Checkpointer(root, fsync=False), resumed, "s2")
    resumed.train_step()
    resumed.train_step()
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))


def test_a_lora_checkpoint_is_refused_against_another_base(tmp_path):
    writer = build_trainer(tmp_path / "w", LORA)
    writer.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "s1")
    other = build_trainer(tmp_path / "other", [*LORA, "model.init_seed=99"])
    other.train_step()
    before = snapshot(other)
    with pytest.raises(CheckpointError, match="trained on another base model.*init_seed"):
        load_with(Checkpointer(root, fsync=False), other, "s1")
    assert_bitwise_equal(before, snapshot(other), "live state")
    with pytest.raises(CheckpointError, match="another base model"):  # weights only too
        load_with(Checkpointer(root, fsync=False), other, "s1", load_optimizer=False)


# ------------------------------------------------------------------------------ 2 ranks
EXPERTS = ["model=tiny_moe", "parallel=fsdp_ep2", "lora.target_experts=[gate_up_proj,down_proj]"]


def _two_rank_resume(ctx, out: Path, overrides: list[str]) -> dict:
    common = [*LORA, *overrides]
    straight = build_trainer(out / "straight", common, ctx)
    for _ in range(4):
        straight.train_step()
    first = build_trainer(out / "first", common, ctx)
    first.train_step()
    first.train_step()
    save_with(Checkpointer(out / "ckpt", fsync=False), first, "s2")
    resumed = build_trainer(out / "resumed", common, ctx)
    load_with(Checkpointer(out / "ckpt", fsync=False), resumed, "s2")
    resumed.train_step()
    resumed.train_step()
    for trainer, name in ((straight, "straight"), (resumed, "resumed")):
        save_with(Checkpointer(out / "ckpt", fsync=False), trainer, name)
    shapes = {  # expert adapters: (global, this rank's) number of experts
        name: (p.shape[0], p.to_local().shape[0])
        for name, p in resumed.model.named_parameters()
        if ".experts." in name and ".lora_A." in name
    }
    return {"expert_adapter_shapes": shapes}


@pytest.mark.parametrize(
    "overrides", [["parallel=fsdp"], EXPERTS], ids=["dense_fsdp", "moe_ep2_experts"]
)
def test_lora_resumes_bitwise_on_two_ranks(tmp_path, overrides):
    result = run_ranks(2, _two_rank_resume, tmp_path, overrides)
    if overrides == EXPERTS:  # the adapters are split over ep with their experts
        assert result["expert_adapter_shapes"]
        assert all(local * 2 == full for full, local in result["expert_adapter_shapes"].values())
    from tests.checkpoint.helpers.ckpt_io import differences

    a = read_checkpoint(tmp_path / "ckpt" / "straight")
    b = read_checkpoint(tmp_path / "ckpt" / "resumed")
    assert any(k.endswith(MASTER_WEIGHT) for k in a.tensors)
    if overrides == EXPERTS:
        assert any(".experts." in k and ".lora_A." in k for k in a.tensors)
    assert differences(a, b) == []
