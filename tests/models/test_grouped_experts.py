"""Grouped experts (two ``grouped_mm`` for all local experts) against the per-expert loop
(the former implementation, kept for devices without a sync-free grouped kernel), and
the host synchronisations of an expert-parallel MoE layer.

Tolerance: none. On CPU (torch 2.13) ``grouped_mm`` multiplies each expert's rows with
the same matmul kernel ``F.linear`` uses for that expert alone, so outputs and every
gradient are bitwise equal in FP32 and BF16, including experts with no rows and ranks
with no rows at all. (CUDA's BF16 grouped kernels accumulate in another order; there a
comparison would need a tolerance of a few BF16 ulps.)
"""

from __future__ import annotations

import functools
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tests.distributed.host_syncs import HostSyncCounter
from tests.distributed.spawn import run_ranks
from veoptim.config.schema import ParallelConfig
from veoptim.distributed import DistContext, build_parallel_plan
from veoptim.distributed.expert_parallel import TokenDispatcher
from veoptim.models.experts import (
    ExpertParallelExperts,
    RowGroups,
    experts_forward,
    grouped_mm_applies,
)

pytestmark = pytest.mark.slow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HIDDEN, INTERMEDIATE, NUM_EXPERTS = 64, 32, 8
#: rows per expert: every expert busy; experts 1, 6, 7 idle; no rows at all
ROUTINGS = {"dense": [5, 3, 9, 1, 4, 2, 7, 6], "sparse": [5, 0, 9, 1, 4, 2, 0, 0], "empty": [0] * 8}


def _leaves(counts: list[int], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(sum(counts), HIDDEN), (len(counts), 2 * INTERMEDIATE, HIDDEN)]
    shapes.append((len(counts), HIDDEN, INTERMEDIATE))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _compare(
    counts: list[int], leaves: list[torch.Tensor], grad_out: torch.Tensor | None
) -> dict[str, Any]:
    """Output and gradients of both paths on the same leaves; ``grad_out`` None: ``.sum()``."""
    groups = RowGroups(counts, torch.tensor(counts).cumsum(0).to(torch.int32))
    results = []
    tokens, gate_up, down = leaves
    for grouped in (True, False):  # False: the per-expert loop, the reference
        out = experts_forward(tokens, groups, gate_up, down, F.silu, grouped=grouped)
        loss = out.sum() if grad_out is None else (out * grad_out).sum()
        results.append([out.detach(), *torch.autograd.grad(loss, leaves)])
    (out, *grads), (ref_out, *ref_grads) = results
    idle = [e for e, n in enumerate(counts) if n == 0]
    return {
        "rows": out.shape[0],
        "output_equal": torch.equal(out, ref_out),
        "grads_equal": [torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True)],
        "idle_grads_zero": all(bool((g[idle] == 0).all()) for g in grads[1:]),
    }


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_grouped_experts_equal_the_loop_bitwise(dtype, routing):
    counts = ROUTINGS[routing]
    leaves = _leaves(counts, DTYPES[dtype])
    grad_out = torch.randn(sum(counts), HIDDEN).to(DTYPES[dtype])
    result = _compare(counts, leaves, grad_out)
    assert result["output_equal"] and result["grads_equal"] == [True] * 3
    assert result["idle_grads_zero"]


@pytest.mark.parametrize("routing", ["sparse", "empty"])
def test_grouped_experts_accept_an_expanded_gradient(routing):
    """``out.sum()`` hands back a zero-stride gradient, which ``grouped_mm``'s own backward
    rejects ("Invalid strides/sizes"); the experts densify it first."""
    counts = ROUTINGS[routing]
    result = _compare(counts, _leaves(counts, torch.float32), None)
    assert result["output_equal"] and result["grads_equal"] == [True] * 3


def test_the_sync_counter_sees_every_kind_of_host_read():
    t = torch.tensor([0, 2, 1])
    with HostSyncCounter() as counter:
        t.sum().item(), int(t[0]), t.tolist(), t.cpu(), t.numpy()
        torch.bincount(t), torch.repeat_interleave(t, t), t.nonzero(), t[t > 0]
    with HostSyncCounter() as quiet:  # what the dispatcher uses instead
        torch.repeat_interleave(t, t, output_size=3), torch.zeros(3).scatter_add_(0, t, t.float())
        torch.argsort(t, stable=True), torch.cumsum(t, 0), t[torch.tensor([2, 0])]
    assert counter.total == 9, counter.by_name
    assert quiet.total == 0, quiet.by_name
    assert "tolist" not in torch.Tensor.__dict__  # the wrappers are gone again


# ---- two ranks, ep=2 ---------------------------------------------------------------


def _moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
    )


def _layer_syncs(ctx: DistContext, plan: Any, grouped: bool | None) -> dict[str, Any]:
    """Host syncs of one MoE block (router + EP experts), forward and backward, and how
    many grouped matmuls ran."""
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(_moe_config())
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    dispatcher = TokenDispatcher(plan.meshes.ep.get_group(), NUM_EXPERTS)
    block.experts = ExpertParallelExperts(block.experts, dispatcher, plan.meshes.ep)
    block.experts.grouped = grouped
    x = torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(ctx.rank))
    with HostSyncCounter() as counter:
        block(x).pow(2).sum().backward()
    return {"syncs": dict(counter.by_name), "grouped_mm": counter.ops["aten._grouped_mm.default"]}


def _rank_without_rows(ctx: DistContext, plan: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Every pair goes to experts 0-3 (rank 0's): rank 1 computes zero rows. The grouped
    path equals the loop on the dispatched rows, and the module equals transformers'."""
    group = plan.meshes.ep.get_group()
    g = torch.Generator().manual_seed(10 + ctx.rank)
    hidden = torch.randn(12, HIDDEN, generator=g).to(dtype)
    ids = torch.randint(0, NUM_EXPERTS // 2, (12, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % (NUM_EXPERTS // 2)
    dispatcher = TokenDispatcher(group, NUM_EXPERTS)
    rows, groups, _ = dispatcher.dispatch(hidden, ids)
    local = dispatcher.local_expert_ids
    _, gate_up, down = _leaves([0] * NUM_EXPERTS, dtype, seed=3)
    weights = [
        w.detach()[local.start : local.stop].clone().requires_grad_() for w in (gate_up, down)
    ]
    leaves = [rows.detach().clone().requires_grad_(), *weights]
    grad_out = torch.randn(rows.shape[0], HIDDEN, generator=g).to(dtype)
    result = _compare(groups.counts, leaves, grad_out)
    result["offsets_are_the_counts"] = groups.offsets.tolist() == list(accumulate(groups.counts))
    if dtype == torch.float32:  # the whole module against transformers' experts
        torch.manual_seed(0)
        reference = Qwen3MoeSparseMoeBlock(_moe_config()).experts
        with torch.no_grad():
            reference.gate_up_proj.copy_(gate_up)
            reference.down_proj.copy_(down)
        module = ExpertParallelExperts(reference, dispatcher, plan.meshes.ep)
        route = torch.rand(12, 2, generator=g)
        out = module(hidden, ids, route)
        out.pow(2).sum().backward()
        ref_out = reference(hidden, ids, route)
        ref_out.pow(2).sum().backward()
        result["module_output_diff"] = ((out - ref_out).abs().max() / ref_out.abs().max()).item()
        for name in ("gate_up_proj", "down_proj"):
            ref_grad = getattr(reference, name).grad.clone()
            dist.all_reduce(ref_grad)
            grad = getattr(module, name).grad.full_tensor()
            result[f"module_{name}_diff"] = (
                (grad - ref_grad).abs().max() / ref_grad.abs().max()
            ).item()
    return result


def _two_rank_checks(ctx: DistContext, out: Path) -> dict[str, Any]:
    plan = build_parallel_plan(ParallelConfig(ep=ctx.world_size), ctx, NUM_EXPERTS)
    mine = {
        "syncs": _layer_syncs(ctx, plan, None),
        "syncs_loop": _layer_syncs(ctx, plan, False),
        **{f"no_rows_{name}": _rank_without_rows(ctx, plan, dt) for name, dt in DTYPES.items()},
    }
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return {"ranks": every}


@functools.cache
def _two_ranks(root: str) -> dict[str, Any]:
    return run_ranks(2, _two_rank_checks, Path(root))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, Any]:
    return _two_ranks(str(tmp_path_factory.mktemp("grouped_experts")))


def test_an_ep_moe_layer_synchronises_with_the_host_once(two_ranks):
    """Forward and backward of router + dispatch + grouped experts + combine: the one
    ``.tolist()`` that fetches the all-to-all split sizes, on every rank; the per-expert
    path (devices without a sync-free grouped kernel) reads only that list too."""
    for rank in two_ranks["ranks"]:
        assert rank["syncs"]["syncs"] == {"Tensor.tolist": 1}
        assert rank["syncs_loop"]["syncs"] == {"Tensor.tolist": 1}
        assert rank["syncs"]["grouped_mm"] >= 2 and rank["syncs_loop"]["grouped_mm"] == 0


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_rank_without_rows_computes_bitwise_like_the_loop(two_ranks, dtype):
    rank0, rank1 = (r[f"no_rows_{dtype}"] for r in two_ranks["ranks"])
    assert rank0["rows"] == 2 * 12 * 2 and rank1["rows"] == 0
    for result in (rank0, rank1):
        assert result["offsets_are_the_counts"]
        assert result["output_equal"] and result["grads_equal"] == [True] * 3
        assert result["idle_grads_zero"]


def test_the_ep_module_with_an_idle_rank_matches_transformers(two_ranks):
    for rank in two_ranks["ranks"]:
        result = rank["no_rows_fp32"]
        assert result["module_output_diff"] < 1e-6
        assert result["module_gate_up_proj_diff"] < 1e-6
        assert result["module_down_proj_diff"] < 1e-6


def test_grouped_mm_is_chosen_only_where_it_applies_without_a_sync():
    def applies(hidden: int, intermediate: int, dtype: torch.dtype, device: str = "cpu") -> bool:
        tokens = torch.empty(3, hidden, dtype=dtype, device=device)
        return grouped_mm_applies(tokens, torch.empty(2, hidden, intermediate, dtype=dtype))

    assert applies(64, 32, torch.float32) and applies(64, 32, torch.bfloat16)
    assert applies(4, 12, torch.float32)  # rows of 16 and 48 bytes
    assert not applies(4, 6, torch.float32)  # 24-byte rows: grouped_mm refuses them
    assert not applies(4, 12, torch.bfloat16)
    assert not applies(64, 32, torch.bfloat16, device="meta")
