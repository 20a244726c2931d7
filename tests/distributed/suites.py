"""The two multi-rank spawns of the test suite: every check that needs 4 ranks, then every one that needs 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed.workers import equivalence_checks, init_checks, load_checks
from tests.distributed.workers_ep import dispatch_checks, ep_module_checks
from veoptim.distributed import DistContext

FP32 = {"param_dtype": "fp32"}
FOUR_RANK_CASES: dict[str, dict[str, Any]] = {
    "moe_ep2_efsdp2": {"parallel": {"ep": 2, **FP32}, "moe": True, "save": True},
    "moe_hsdp2_ep2": {
        "parallel": {"dp_replicate": 2, "dp_shard": -1, "ep": 2, **FP32},
        "moe": True,
    },
    "moe_one_local_expert": {  # 2 experts over ep=2: expert params sharded over efsdp on dim 1
        "parallel": {"ep": 2, **FP32},
        "moe": True,
        "model_kw": {"num_experts": 2, "top_k": 1},
    },
    "qwen2_moe_ep2_efsdp2": {  # shared expert + gate stay dense (FSDP over dp_shard)
        "parallel": {"ep": 2, **FP32},
        "moe": True,
        "model_kw": {"arch": "qwen2_moe"},
    },
    "moe_bf16": {"parallel": {"ep": 2, "param_dtype": "bf16", "reduce_dtype": "fp32"}, "moe": True},
    "moe_per_rank_mean": {"parallel": {"ep": 2, **FP32}, "moe": True, "per_rank_mean": True},
}
TWO_RANK_CASES: dict[str, dict[str, Any]] = {
    "dense_fsdp2": {"parallel": FP32, "moe": False},
    "dense_bf16": {"parallel": {"param_dtype": "bf16", "reduce_dtype": "fp32"}, "moe": False},
    "dense_per_rank_mean": {"parallel": FP32, "moe": False, "per_rank_mean": True},
}
FOUR_RANK_INITS: dict[str, dict[str, Any]] = {
    "moe_ep2_efsdp2": {"parallel": {"ep": 2}, "moe": True},
    "qwen2_moe_hsdp2_ep2": {
        "parallel": {"dp_replicate": 2, "dp_shard": -1, "ep": 2},
        "moe": True,
        "model_kw": {"arch": "qwen2_moe"},
    },
}
TWO_RANK_INITS: dict[str, dict[str, Any]] = {
    "dense_fsdp2": {"parallel": {}, "moe": False},
    "moe_ep2_from_path": {"parallel": {"ep": 2}, "moe": True, "from_path": True},
}
TWO_RANK_LOADS: dict[str, dict[str, Any]] = {
    "ep2": {"parallel": {"ep": 2, **FP32}},
    "fsdp2_ep1": {"parallel": FP32},
}


def four_rank_suite(ctx: DistContext, out: Path) -> dict[str, Any]:
    return {
        "dispatch": dispatch_checks(ctx),
        "ep_module": ep_module_checks(ctx),
        "train": equivalence_checks(ctx, out, FOUR_RANK_CASES),
        "init": init_checks(ctx, out, FOUR_RANK_INITS),
    }


def two_rank_suite(ctx: DistContext, out: Path, ckpt: str) -> dict[str, Any]:
    return {
        "train": equivalence_checks(ctx, out, TWO_RANK_CASES),
        "init": init_checks(ctx, out, TWO_RANK_INITS),
        "load": load_checks(ctx, out, ckpt, TWO_RANK_LOADS),
    }
