"""Where one ``Trainer.train_step`` spends its time: a ``torch.profiler`` breakdown.

Builds the trainer of ``peer_trl.py`` (same models, variants and batches), runs warm-up
steps, then profiles one step and prints the top operators by self CPU time and one JSON
line with the step's time grouped by kind (matrix products, attention, element-wise,
copies and casts, optimizer, the rest).

    .venv/bin/python scripts/bench/step_profile.py [--model qwen2_26m] [--variant veoptim_eager]
        [--global-batch 64] [--micro-batch 16] [--threads 1] [--rows 25]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.peer_trl import MODELS, VEOPTIM_VARIANTS, compose  # noqa: E402

#: Operator name fragments of each kind (first match wins; the rest is "other").
KINDS = {
    "optimizer": ("Optimizer.step",),
    "attention": ("attention", "bmm", "softmax"),
    "matmul": ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear"),
    "copies_and_casts": ("copy_", "_to_copy", "index_copy", "index_select", "clone"),
    "elementwise": ("mul", "add", "silu", "pow", "rsqrt", "div", "neg", "cat", "sum", "mean"),
}


def kind(name: str) -> str:
    return next((k for k, parts in KINDS.items() if any(p in name for p in parts)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_26m", choices=sorted(MODELS))
    parser.add_argument("--variant", default="veoptim_eager", choices=sorted(VEOPTIM_VARIANTS))
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from veoptim.distributed import init_distributed
    from veoptim.trainer import Trainer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="veoptim-profile-") as tmp:
        spec = {"model": args.model, "run_dir": tmp, "global_batch": args.global_batch,
                "micro_batch": args.micro_batch, "dtype": "bf16", "warmup": args.warmup,
                "steps": 20}  # fmt: skip
        cfg = compose(spec, VEOPTIM_VARIANTS[args.variant])
        trainer = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))
        trainer.model.train()
        for _ in range(args.warmup):
            unprofiled = trainer.train_step()["step_time_s"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            metrics = trainer.train_step()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total = sum(e.self_cpu_time_total for e in events)
    kinds: dict[str, float] = {}
    for e in events:
        kinds[kind(e.key)] = kinds.get(kind(e.key), 0.0) + e.self_cpu_time_total
    print(json.dumps({
        "bench": "step_profile", "model": args.model, "variant": args.variant,
        "global_batch": args.global_batch, "micro_batch": trainer.sampler.micro_batch_size,
        "threads": args.threads, "last_unprofiled_step_s": round(unprofiled, 3),
        "profiled_step_s": round(metrics["step_time_s"], 3),
        "tokens": round(metrics["tokens_per_s"] * metrics["step_time_s"]),
        "self_cpu_share": {k: round(v / total, 3) for k, v in sorted(kinds.items())},
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
