"""Optimizer step time per parameter vs torch's fused FP32 AdamW and vs copy bandwidth.

Every variant steps the same parameter count, split into tensors of realistic
sizes, in this process; variants are interleaved round by round so machine noise
hits them alike, and each figure is the best round. The baseline is
``torch.optim.AdamW(fused=True)`` on FP32 parameters (28 bytes moved per
parameter). ``copy_GBps`` is a measured FP32 tensor copy (read + write) on the
same device: ``fraction_of_copy_bw`` = (ideal bytes per parameter x count / time)
/ copy bandwidth. Prints one JSON line. Target: full_fp32_adamw and master_fp32_adamw within
1.25x of the baseline.

    .venv/bin/python scripts/bench/optimizer_step.py [--numel 8388608] [--rounds 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from veoptim.optim import AdamW, CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BASELINE = "torch_fused_adamw_fp32"

# name -> (parameter dtype, factory, ideal bytes moved per parameter)
VARIANTS: dict[str, tuple[torch.dtype, Callable[[list], torch.optim.Optimizer], int]] = {
    BASELINE: (torch.float32, lambda p: torch.optim.AdamW(p, fused=True, **HYPER), 28),
    # master 4+4, grad 2, moments 4+4 read and written, param 2 written
    "full_fp32_adamw_bf16_params": (torch.bfloat16, lambda p: FullFP32AdamW(p, **HYPER), 28),
    # master 4+4, grad 2, moments 2+2 read and written, param 2 written
    "master_fp32_adamw_bf16_params": (torch.bfloat16, lambda p: MasterFP32AdamW(p, **HYPER), 20),
    # parameter is its own master: exactly torch's fused update
    "full_fp32_adamw_fp32_params": (torch.float32, lambda p: FullFP32AdamW(p, **HYPER), 28),
    "master_fp32_adamw_fp32_params": (torch.float32, lambda p: MasterFP32AdamW(p, **HYPER), 20),
    "cpu_offload_adamw_bf16_params": (
        torch.bfloat16,
        lambda p: CPUOffloadAdamW([{"params": p, "cpu_offload": True}], **HYPER),
        28,
    ),
    "adamw_bf16_params": (torch.bfloat16, lambda p: AdamW(p, fused=True, **HYPER), 14),
}


def split_sizes(numel: int) -> list[int]:
    """A transformer-like mix: a few large matrices, medium ones and small norm vectors."""
    sizes = [numel // 4, numel // 4, numel // 8, numel // 8, numel // 16, numel // 16]
    sizes += [4096] * 16
    sizes.append(numel - sum(sizes))
    return sizes


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def make(name: str, numel: int, device: torch.device):
    dtype, factory, _ = VARIANTS[name]
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device, dtype))
        for n in split_sizes(numel)
    ]
    for p in params:
        p.grad = (torch.randn(p.numel(), generator=g) * 1e-3).to(device, dtype)
    opt = factory(params)
    opt.step()  # creates state; the timed steps are steady-state steps
    return opt


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    src = torch.randn(args.numel, device=device)
    dst = torch.empty_like(src)
    optimizers = {name: make(name, args.numel, device) for name in VARIANTS}
    best = {name: float("inf") for name in VARIANTS}
    copy_best = float("inf")
    for _ in range(args.rounds):
        copy_best = min(copy_best, time_once(lambda: dst.copy_(src), device))
        for name, opt in optimizers.items():
            best[name] = min(best[name], time_once(opt.step, device))
    copy_gbps = 8 * args.numel / copy_best / 1e9
    base = best[BASELINE]
    variants = {}
    for name, seconds in best.items():
        ideal = VARIANTS[name][2]
        gbps = ideal * args.numel / seconds / 1e9
        variants[name] = {
            "ns_per_param": round(seconds * 1e9 / args.numel, 4),
            "ratio_vs_fused_adamw": round(seconds / base, 3),
            "ideal_bytes_per_param": ideal,
            "GBps": round(gbps, 2),
            "fraction_of_copy_bw": round(gbps / copy_gbps, 3),
        }
    print(
        json.dumps(
            {
                "bench": "optimizer_step",
                "device": str(device),
                "numel": args.numel,
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "copy_GBps": round(copy_gbps, 2),
                "targets": {"full_fp32_adamw": 1.25, "master_fp32_adamw": 1.25},
                "variants": variants,
            }
        )
    )


if __name__ == "__main__":
    main()
