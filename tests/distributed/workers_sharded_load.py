"""Rank bodies of tests/models/test_sharded_load.py: a model.path loaded both ways
(each rank from the files, and rank 0 broadcasting) under several layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed.workers import full
from veoptim.config.schema import ParallelConfig
from veoptim.distributed import DistContext, build_parallel_plan
from veoptim.models import build_model
from veoptim.objectives import SFTConfig
from veoptim.trainer.model_setup import unsharded_model


def load_both_ways(ctx: DistContext, out: Path, cases: dict[str, dict[str, Any]]) -> dict:
    """Per case: whether the files were used, and every tensor and buffer that differs
    (whole tensors, gathered) between the two ways."""
    results: dict[str, Any] = {}
    for name, case in cases.items():
        cfg = SFTConfig()
        cfg.model.path, cfg.model.dtype = case["path"], case["dtype"]
        num_experts = case["num_experts"]
        plan = build_parallel_plan(ParallelConfig(**case["parallel"]), ctx, num_experts)
        skeleton, files = unsharded_model(cfg, ctx, vocab=0, special={})
        from_files = plan.apply(skeleton, shards=files)
        on_meta = not ctx.is_main
        broadcast = plan.apply(build_model(cfg.model, 0, {}, on_meta=on_meta))
        a, b = from_files.state_dict(), broadcast.state_dict()
        mismatched = sorted(k for k in b if not torch.equal(full(a[k]), full(b[k])))
        buffers_a, buffers_b = dict(from_files.named_buffers()), dict(broadcast.named_buffers())
        results[name] = {
            "used_files": files is not None,
            "same_keys": sorted(a) == sorted(b),
            "mismatched": mismatched,
            "mismatched_buffers": sorted(
                k for k in buffers_b if not torch.equal(buffers_a[k], buffers_b[k])
            ),
            "dtypes": sorted({str(full(v).dtype) for v in a.values()}),
        }
    return results
