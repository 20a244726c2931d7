"""Activation checkpointing on and off, trained side by side: the runs and their comparison.

Each case builds the same model twice (``model.activation_checkpointing`` false, then
true, optionally with LoRA), applies the same parallel plan, seeds the RNG the same
way (dropout draws from it) and trains a few AdamW steps on this rank's rows; the
losses and every step's full gradients must be bitwise equal. Used in one process
by the tests and on 2 gloo ranks by the spawned suite.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers.modeling_layers import GradientCheckpointingLayer

from tests.distributed.workers import full
from veoptim.config.schema import LoRAConfig, ModelConfig, ParallelConfig
from veoptim.distributed import DistContext, ParallelPlan, build_parallel_plan
from veoptim.lora import apply_lora
from veoptim.models.activation_checkpointing import checkpointed_layers
from veoptim.models.build import build_model

VOCAB = 128
SEQ_LEN = 24
BATCH = 4  # global rows, split over the data-parallel ranks
STEPS = 2
IGNORE = -100
DROPOUT = 0.1

DENSE = ModelConfig(arch="qwen2", attention_dropout=DROPOUT)
MOE = ModelConfig(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN2_MOE = replace(MOE, arch="qwen2_moe")
LORA = LoRAConfig(enabled=True, r=4, dropout=DROPOUT)  # adapter dropout: another RNG draw
LORA_EXPERTS = LoRAConfig(enabled=True, r=4, target_experts=["gate_up_proj", "down_proj"])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed ids and labels; row ``i`` masks its first ``3 * i`` labels."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    for i in range(BATCH):
        labels[i, : 3 * i] = IGNORE
    return ids, labels


def build(
    cfg: ModelConfig,
    lora: LoRAConfig | None,
    plan: ParallelPlan | None,
    on_meta: bool = False,
) -> nn.Module:
    """As the trainer does: build, inject LoRA, apply the plan."""
    model = build_model(cfg, VOCAB, on_meta=on_meta)
    if lora is not None:
        apply_lora(model, lora, seed=cfg.init_seed)
    return (plan.apply(model) if plan is not None else model).train()


def train(
    model: nn.Module, plan: ParallelPlan | None, ids: torch.Tensor, labels: torch.Tensor
) -> dict[str, Any]:
    """``STEPS`` AdamW steps on the SFT loss contract; every step's loss and full gradients."""
    torch.manual_seed(1234 + (plan.ctx.rank if plan is not None else 0))  # dropout masks
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, foreach=False)
    reduce = plan.all_reduce_sum if plan is not None else (lambda x: x.clone())
    count = reduce((labels[:, 1:] != IGNORE).sum())
    losses, grads = [], []
    for _ in range(STEPS):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )
            / count
        )
        loss.backward()
        losses.append(reduce(loss.detach()))
        grads.append(
            {n: full(p.grad).clone() for n, p in model.named_parameters() if p.requires_grad}
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "keys": sorted(get_model_state_dict(model))}


def bitwise_diff(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """What differs between two runs: losses and gradients compared with ``torch.equal``."""
    return {
        "same_keys": run["keys"] == ref["keys"],
        "num_grads": sum(len(g) for g in ref["grads"]),
        "losses_equal": all(
            torch.equal(a, b) for a, b in zip(run["losses"], ref["losses"], strict=True)
        ),
        "unequal_grads": sorted(
            f"step{step}:{name}"
            for step, (got, want) in enumerate(zip(run["grads"], ref["grads"], strict=True))
            for name in want
            if name not in got or not torch.equal(got[name], want[name])
        ),
        "losses": [x.item() for x in run["losses"]],
    }


def without_rng_restore(model: nn.Module) -> nn.Module:
    """Negative control: recompute without restoring the RNG state (dropout masks differ)."""
    func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False)
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._gradient_checkpointing_func = func
    return model


def run_case(
    case: dict[str, Any], plan: ParallelPlan | None, on_meta: bool = False
) -> dict[str, Any]:
    """Train the case with checkpointing off and on (or its ``control``); compare bitwise.

    A case: ``model`` (ModelConfig), optional ``lora``, optional ``control``:
    ``"seed"`` (the checkpointed run starts from other weights) or ``"no_rng_restore"``.
    """
    cfg, lora, control = case["model"], case.get("lora"), case.get("control")
    ids, labels = batch()
    if plan is not None:
        rows = BATCH // plan.dp_size
        ids, labels = (t[plan.dp_rank * rows : (plan.dp_rank + 1) * rows] for t in (ids, labels))
    ref = train(build(cfg, lora, plan, on_meta), plan, ids, labels)
    ac_cfg = replace(cfg, activation_checkpointing=True)
    if control == "seed":
        ac_cfg = replace(ac_cfg, init_seed=cfg.init_seed + 1)
    model = build(ac_cfg, lora, plan, on_meta)
    if control == "no_rng_restore":
        without_rng_restore(model)
    result = bitwise_diff(train(model, plan, ids, labels), ref)
    result["checkpointed_layers"] = checkpointed_layers(model)
    return result


def ac_suite(ctx: DistContext, out: Path, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every case on this world (``parallel`` kwargs per case); rank 0's comparisons."""
    results = {}
    for name, case in cases.items():
        num_experts = case["model"].num_experts
        plan = build_parallel_plan(ParallelConfig(**case["parallel"]), ctx, num_experts)
        results[name] = run_case(case, plan, on_meta=not ctx.is_main)
        results[name]["layout"] = plan.layout_metadata().to_json()
    return results
