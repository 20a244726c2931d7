"""Peak host memory per rank when starting from ``model.path``, on 1, 2 and 4 ranks.

A dense Qwen2 (``--hidden`` / ``--layers``, FP32 weights, ``save_pretrained`` into a temp
dir) is loaded the way a training job does, in fresh gloo processes per world size and
way: ``files`` (every rank reads only its shards from the safetensors files) and
``rank0`` (rank 0 loads the whole model and broadcasts every shard: the way before, and
still the way for LoRA and files with other layouts). Each rank reports its peak RSS
(``VmHWM``) after the sharded model is ready and its RSS before building the model
(interpreter, torch, transformers); ``growth_mb`` is the difference, the memory the load
itself needed. The ideal ``files`` growth per rank is its shard, ``model_mb / world``.
Prints one JSON line.

    .venv/bin/python scripts/bench/sharded_load.py [--hidden 768] [--layers 12] [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from veoptim.config.schema import ModelConfig
from veoptim.distributed import build_parallel_plan, init_distributed
from veoptim.models import build_model
from veoptim.objectives import SFTConfig
from veoptim.trainer.model_setup import unsharded_model

VOCAB = 32000
HEAD_DIM = 64


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited from the
    process that spawned it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rank_main(rank: int, world: int, port: int, path: str, way: str, out: str) -> None:
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    ctx = init_distributed("cpu", "gloo", env)
    try:
        cfg = SFTConfig()
        cfg.model.path = path
        before = rss_mb()
        plan = build_parallel_plan(cfg.parallel, ctx, num_experts=0)
        if way == "files":
            model, files = unsharded_model(cfg, ctx, vocab=0, special={})
            assert files is not None or world == 1
        else:
            model, files = build_model(cfg.model, 0, {}, on_meta=not ctx.is_main), None
        plan.apply(model, shards=files)
        peak = peak_rss_mb()
        Path(out, f"{way}.{world}.{rank}.json").write_text(
            json.dumps({"before_mb": round(before, 1), "peak_mb": round(peak, 1)})
        )
    finally:
        ctx.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="veoptim-sharded-load-"))
    try:
        heads = args.hidden // HEAD_DIM
        cfg = ModelConfig(
            hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=heads,
            num_key_value_heads=heads, dtype="fp32",
        )  # fmt: skip
        model = build_model(cfg, VOCAB)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(work / "model")
        del model
        results: dict[str, dict] = {}
        for world in args.worlds:
            for way in ("rank0", "files"):
                mp.spawn(rank_main, args=(world, free_port(), str(work / "model"), way,
                                          str(work)), nprocs=world)  # fmt: skip
                ranks = [json.loads((work / f"{way}.{world}.{r}.json").read_text())
                         for r in range(world)]  # fmt: skip
                growth = [r["peak_mb"] - r["before_mb"] for r in ranks]
                results.setdefault(str(world), {})[way] = {
                    "peak_rss_mb_per_rank": [r["peak_mb"] for r in ranks],
                    "growth_mb_per_rank": [round(g, 1) for g in growth],
                    "max_growth_mb": round(max(growth), 1),
                }
            w = results[str(world)]
            w["max_growth_ratio_files_vs_rank0"] = round(
                w["files"]["max_growth_mb"] / w["rank0"]["max_growth_mb"], 3
            )
        model_mb = params * 4 / 2**20
        print(json.dumps({
            "bench": "sharded_load", "params": params, "model_mb": round(model_mb, 1),
            "ideal_files_growth_mb": {str(w): round(model_mb / w, 1) for w in args.worlds},
            "worlds": results, "cpus": os.cpu_count(),
            "loadavg_1min": round(os.getloadavg()[0], 2),
        }))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
