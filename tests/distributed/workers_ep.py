"""Rank functions that test expert-parallel dispatch and the EP experts module directly.

Inputs are a deterministic function of (rank, token), so every rank can work out
what every other rank sends and check exactly what arrives and what returns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from veoptim.config.schema import ParallelConfig
from veoptim.distributed import DistContext, build_parallel_plan
from veoptim.distributed.expert_parallel import TokenDispatcher
from veoptim.models.experts import ExpertParallelExperts

NUM_EXPERTS = 8  # expert 7 never receives a token; id 8 marks a dropped pair
TOKENS = 5
TOP_K = 2
HIDDEN = 4
UNUSED_EXPERT = 7


def rank_tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows ``[rank, t, 1, -t]`` and expert ids avoiding expert 7 (rank 1 drops one pair)."""
    t = torch.arange(TOKENS, dtype=torch.float32)
    hidden = torch.stack([torch.full_like(t, rank), t, torch.ones_like(t), -t], dim=1)
    ids = torch.stack(
        [(rank + torch.arange(TOKENS) + 3 * k) % UNUSED_EXPERT for k in range(TOP_K)], dim=1
    )
    if rank == 1:
        ids[0, 1] = NUM_EXPERTS
    return hidden, ids


def dispatch_checks(ctx: DistContext) -> dict[str, Any]:
    """Rows reach the owner of their expert in (source rank, token) order and come back in order."""
    plan = build_parallel_plan(ParallelConfig(ep=ctx.world_size), ctx, NUM_EXPERTS)
    dispatcher = TokenDispatcher(plan.meshes.ep.get_group(), NUM_EXPERTS)
    hidden, ids = rank_tokens(ctx.rank)
    hidden.requires_grad_(True)
    rows, per_expert, state = dispatcher.dispatch(hidden, ids)
    expected_rows, expected_counts = [], []
    for g in dispatcher.local_expert_ids:
        block = []
        for src in range(ctx.world_size):
            src_hidden, src_ids = rank_tokens(src)
            for t, k in zip(*torch.where(src_ids == g), strict=True):
                block.append((int(t), int(k), src_hidden[t]))
        block.sort(
            key=lambda item: (item[2][0].item(), item[0] * TOP_K + item[1])
        )  # source rank, pair order
        expected_rows += [row for _, _, row in block]
        expected_counts.append(len(block))
    arrived_ok = per_expert.counts == expected_counts and torch.equal(
        rows.detach(), torch.stack(expected_rows) if expected_rows else rows.new_zeros((0, HIDDEN))
    )
    scale = torch.repeat_interleave(
        torch.tensor([g + 1.0 for g in dispatcher.local_expert_ids]),
        torch.tensor(per_expert.counts),
    )
    pairs = dispatcher.combine(rows * scale[:, None], state).view(TOKENS, TOP_K, HIDDEN)
    valid = (ids < NUM_EXPERTS).float()
    expected_pairs = hidden.detach()[:, None, :] * ((ids + 1).float() * valid)[:, :, None]
    weights = torch.linspace(0.5, 1.5, TOKENS * TOP_K).view(TOKENS, TOP_K)
    (pairs * weights[:, :, None]).sum().backward()
    expected_grad = (
        ((ids + 1).float() * valid * weights).sum(1, keepdim=True).expand(TOKENS, HIDDEN)
    )
    return {
        "arrived_in_order": bool(arrived_ok),
        "counts": per_expert.counts,
        "returned_in_order": bool(torch.equal(pairs.detach(), expected_pairs)),
        "input_grad_ok": bool(torch.equal(hidden.grad, expected_grad)),
    }


def ep_module_checks(ctx: DistContext) -> dict[str, Any]:
    """ExpertParallelExperts equals the transformers experts module, outputs and gradients."""
    plan = build_parallel_plan(ParallelConfig(ep=ctx.world_size), ctx, NUM_EXPERTS)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=6, num_experts=NUM_EXPERTS)
    torch.manual_seed(0)
    reference = Qwen3MoeExperts(config)
    torch.nn.init.normal_(reference.gate_up_proj)
    torch.nn.init.normal_(reference.down_proj)
    dispatcher = TokenDispatcher(plan.meshes.ep.get_group(), NUM_EXPERTS)
    module = ExpertParallelExperts(reference, dispatcher, plan.meshes.ep)
    hidden, ids = rank_tokens(ctx.rank)
    ids = ids.clamp(max=NUM_EXPERTS - 2)  # no dropped pairs here; expert 7 still idle
    weights = torch.linspace(0.2, 0.8, TOKENS * TOP_K).view(TOKENS, TOP_K)
    out = module(hidden, ids, weights)
    out.pow(2).sum().backward()
    ref_out = reference(hidden, ids, weights)
    ref_out.pow(2).sum().backward()
    diffs = {}  # relative to the largest reference value
    for name in ("gate_up_proj", "down_proj"):
        ref_grad = getattr(reference, name).grad.clone()
        torch.distributed.all_reduce(ref_grad)  # every rank's tokens contribute to each expert
        grad = getattr(module, name).grad.full_tensor()
        diffs[name] = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
        diffs[f"{name}_idle_expert_grad"] = grad[UNUSED_EXPERT].abs().max().item()
    return {"output_diff": ((out - ref_out).abs().max() / ref_out.abs().max()).item(), **diffs}
