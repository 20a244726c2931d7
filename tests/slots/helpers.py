"""Shared pieces of the slot tests: a small SlotTrainer, batches of bundled examples, and a
bitwise comparison of slot states."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from veoptim.data import collate, load_sft_dataset, load_tokenizer
from veoptim.distributed import DistContext
from veoptim.slots import SLOT_IDS, MultiLoRAConfig, SlotTrainer

#: Per-parameter tensors a slot state holds (``SlotTrainer.slot_state``).
TENSOR_KEYS = ("weights", "master_weight", "exp_avg", "exp_avg_sq", "step")
SEQ_LEN = 48


def slot_config(run_dir: Path, **overrides: Any) -> MultiLoRAConfig:
    """BF16 adapters with FP32 masters (full_fp32_adamw), 4 slots of rank <= 8."""
    cfg = MultiLoRAConfig()
    cfg.run.dir = str(run_dir)
    cfg.model.dtype = "bf16"
    cfg.lora.num_slots, cfg.lora.r, cfg.lora.alpha = 4, 8, 16.0
    cfg.lora.target_modules = ["q_proj", "v_proj", "down_proj"]
    cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay = "full_fp32_adamw", 1e-2, 0.01
    cfg.scheduler.name, cfg.scheduler.warmup_steps = "cosine", 2
    cfg.train.max_steps = 20
    cfg.data.max_seq_len = SEQ_LEN
    cfg.checkpoint.fsync = False
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        setattr(getattr(cfg, section), field, value)
    return cfg


def build(run_dir: Path, ctx: DistContext | None = None, **overrides: Any) -> SlotTrainer:
    return SlotTrainer.from_config(slot_config(run_dir, **overrides), ctx)


@cache
def _dataset() -> tuple[list[dict[str, torch.Tensor]], int]:
    tokenizer = load_tokenizer()
    return load_sft_dataset("", tokenizer, SEQ_LEN, False).items, tokenizer.pad_token_id


def batch(rows: list[int], slots: list[int]) -> dict[str, torch.Tensor]:
    """Bundled examples ``rows`` (indices), row ``i`` tagged with slot ``slots[i]``."""
    examples, pad_id = _dataset()
    out = collate([examples[i] for i in rows], pad_id)
    out[SLOT_IDS] = torch.tensor(slots)
    return out


def train(trainer: SlotTrainer, steps: int, slots: list[int], start: int = 0) -> None:
    """``steps`` mixed steps: two rows per slot, different rows every step and slot."""
    per_step = 2 * len(slots)
    for step in range(steps):
        first = start + step * per_step
        trainer.train_step(
            batch(list(range(first, first + per_step)), [s for s in slots for _ in range(2)])
        )


def state(trainer: SlotTrainer, slot: int) -> dict[str, Any]:
    return trainer.slot_state(slot)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two slot states (tensors bitwise, dtype included; JSON exactly)."""
    out = []
    for key in TENSOR_KEYS:
        if set(a[key]) != set(b[key]):
            out.append(f"{key}: names differ")
            continue
        for name, x in a[key].items():
            y = b[key][name]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(f"{key}.{name}")
    for key in ("param_groups", "scheduler", "spec", "steps"):
        if a[key] != b[key]:
            out.append(key)
    return out


def all_states(trainer: SlotTrainer) -> dict[int, dict[str, Any]]:
    return {slot: trainer.slot_state(slot) for slot in sorted(trainer.slots)}


def assert_unchanged(before: dict[int, dict[str, Any]], trainer: SlotTrainer) -> None:
    after = all_states(trainer)
    assert sorted(after) == sorted(before)
    for slot in before:
        assert differences(before[slot], after[slot]) == [], f"slot {slot} changed"
