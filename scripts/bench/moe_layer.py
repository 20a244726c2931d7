"""MoE layer forward+backward tokens/s: grouped experts (after) vs one matmul pair per expert (before).

One Qwen3-MoE sparse block (router + :class:`ExpertParallelExperts` over a one-rank gloo
group: dispatch, experts, combine), BF16 on CPU, at 8 and 64 experts. The "before"
variant is the same module with ``grouped = False``: the former per-expert loop (still
the path of devices without a sync-free grouped kernel); both hold the same weights and
see the same input. Variants are interleaved round by round (order alternating) so
machine noise hits them alike; each figure is the median round. Prints one JSON line.

    .venv/bin/python scripts/bench/moe_layer.py [--tokens 4096] [--experts 8 64] [--repeats 9] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from veoptim.distributed.context import import_group_capturing_modules, release_process_groups
from veoptim.distributed.expert_parallel import TokenDispatcher
from veoptim.models.experts import ExpertParallelExperts


def build(args: argparse.Namespace, num_experts: int, mesh) -> dict[str, torch.nn.Module]:
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=num_experts,
        num_experts_per_tok=args.top_k,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():  # the router starts at zero: every token would tie
        torch.nn.init.normal_(param, std=0.02)
    block.to(torch.bfloat16)
    variants = {}
    for name, grouped in (("before_loop", False), ("after_grouped", True)):
        variant = copy.deepcopy(block)
        dispatcher = TokenDispatcher(mesh.get_group(), num_experts)
        variant.experts = ExpertParallelExperts(variant.experts, dispatcher, mesh)
        variant.experts.grouped = grouped
        variants[name] = variant
    return variants


def step(block: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    block.zero_grad(set_to_none=True)
    x.grad = None
    out = block(x)
    out.backward(grad)
    return out.detach()


def measure(args: argparse.Namespace, num_experts: int, mesh) -> dict[str, object]:
    variants = build(args, num_experts, mesh)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(1, args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    outs = {name: step(block, x, grad) for name, block in variants.items()}  # warm-up
    same = torch.equal(*outs.values())
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            step(variants[name], x, grad)
            times[name].append(time.perf_counter() - start)
    result: dict[str, object] = {"outputs_bitwise_equal": same}
    for name, ts in times.items():
        median = statistics.median(ts)
        result[f"{name}_ms"] = round(median * 1e3, 2)
        result[f"{name}_tokens_per_s"] = round(args.tokens / median)
    result["ratio_after_over_before"] = round(
        result["after_grouped_tokens_per_s"] / result["before_loop_tokens_per_s"], 2
    )
    return result


def measure_all(args: argparse.Namespace) -> dict[str, dict]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    return {str(n): measure(args, n, mesh) for n in args.experts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    import_group_capturing_modules()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        experts = measure_all(args)
    finally:
        release_process_groups()  # after measure_all's mesh is gone, so its threads join
    print(
        json.dumps(
            {
                "bench": "moe_layer",
                "device": "cpu",
                "dtype": "bf16",
                "threads": torch.get_num_threads(),
                "tokens": args.tokens,
                "hidden": args.hidden,
                "expert_intermediate": args.intermediate,
                "top_k": args.top_k,
                "repeats": args.repeats,
                "statistic": "median of interleaved rounds, forward+backward",
                "experts": experts,
                "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
