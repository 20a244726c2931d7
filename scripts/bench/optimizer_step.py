"""Optimizer step time per parameter vs torch's fused FP32 AdamW and vs copy bandwidth.

Every variant steps the same parameter count, split into tensors of realistic
sizes, in this process; variants are interleaved round by round so machine noise
hits them alike, and each figure is the best round. The baseline is
``torch.optim.AdamW(fused=True)`` on FP32 parameters (28 bytes moved per
parameter). ``copy_GBps`` is a measured FP32 tensor copy (read + write) on the
same device: ``fraction_of_copy_bw`` = (ideal bytes per parameter x count / time)
/ copy bandwidth. Prints one JSON line (also written to ``--out``). Targets
(CPU, BF16 parameters): full_fp32_adamw <= 1.1x, master_fp32_adamw and
cpu_offload_adamw <= 1.25x of the baseline.

The exact types run with ``kernel="auto"``: on CPU the native one-pass kernel
(``veoptim/optim/kernels/native.py``), on an accelerator the compiled one; the
``*_eager`` variants force the widening engine (the "before" of either), and
``host_update_bf16_params`` is the host kernel alone (the same state on CPU), so
``cpu_offload_adamw`` is reported against the resident step and against that
(the streaming overhead; target <= 1.2x).

    .venv/bin/python scripts/bench/optimizer_step.py [--numel 8388608] [--rounds 7] [--threads N]
        [--device cpu|cuda] [--variants a,b,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from veoptim.optim import AdamW, CPUOffloadAdamW, FullFP32AdamW, MasterFP32AdamW
from veoptim.optim.kernels import compiled as compiled_kernel
from veoptim.optim.kernels import native as native_kernel

HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BASELINE = "torch_fused_adamw_fp32"
HOST = "host"  # the variant's parameters live on the CPU whatever --device is
Factory = Callable[[list], torch.optim.Optimizer]

# name -> (parameter dtype, factory, ideal bytes moved per parameter, placement)
VARIANTS: dict[str, tuple[torch.dtype, Factory, int, str]] = {
    BASELINE: (torch.float32, lambda p: torch.optim.AdamW(p, fused=True, **HYPER), 28, "device"),
    # master 4+4, grad 2, moments 4+4 read and written, param 2 written
    "full_fp32_adamw_bf16_params": (
        torch.bfloat16,
        lambda p: FullFP32AdamW(p, **HYPER),
        28,
        "device",
    ),
    # master 4+4, grad 2, moments 2+2 read and written, param 2 written
    "master_fp32_adamw_bf16_params": (
        torch.bfloat16,
        lambda p: MasterFP32AdamW(p, **HYPER),
        20,
        "device",
    ),
    # parameter is its own master: exactly torch's fused update
    "full_fp32_adamw_fp32_params": (
        torch.float32,
        lambda p: FullFP32AdamW(p, **HYPER),
        28,
        "device",
    ),
    "master_fp32_adamw_fp32_params": (
        torch.float32,
        lambda p: MasterFP32AdamW(p, **HYPER),
        20,
        "device",
    ),
    "cpu_offload_adamw_bf16_params": (
        torch.bfloat16,
        lambda p: CPUOffloadAdamW([{"params": p, "cpu_offload": True}], **HYPER),
        28,
        "device",
    ),
    "adamw_bf16_params": (torch.bfloat16, lambda p: AdamW(p, fused=True, **HYPER), 14, "device"),
    # the eager engine (torch's one-dtype fused kernel on widened operands): on CPU the
    # "before" of the native kernel, on an accelerator the "before" of the compiled one
    "full_fp32_adamw_bf16_params_eager": (
        torch.bfloat16,
        lambda p: FullFP32AdamW(p, kernel="eager", **HYPER),
        28,
        "device",
    ),
    "master_fp32_adamw_bf16_params_eager": (
        torch.bfloat16,
        lambda p: MasterFP32AdamW(p, kernel="eager", **HYPER),
        20,
        "device",
    ),
    "cpu_offload_adamw_bf16_params_eager": (
        torch.bfloat16,
        lambda p: CPUOffloadAdamW([{"params": p, "cpu_offload": True}], kernel="eager", **HYPER),
        28,
        "device",
    ),
    # the host kernel alone (native on CPU where it builds), what offloading streams through
    "host_update_bf16_params": (
        torch.bfloat16,
        lambda p: FullFP32AdamW(p, **HYPER),
        28,
        HOST,
    ),
}
CPU_DEFAULT = [n for n in VARIANTS if n != "host_update_bf16_params"]
ACCEL_DEFAULT = [
    BASELINE,
    "full_fp32_adamw_bf16_params",
    "full_fp32_adamw_bf16_params_eager",
    "master_fp32_adamw_bf16_params",
    "master_fp32_adamw_bf16_params_eager",
    "cpu_offload_adamw_bf16_params",
    "host_update_bf16_params",
    "adamw_bf16_params",
]
TARGETS = {
    "cpu": {
        "full_fp32_adamw_bf16_params": 1.1,
        "master_fp32_adamw_bf16_params": 1.25,
        "cpu_offload_adamw_bf16_params": 1.25,
    },
    "accelerator": {"offload_vs_host_update": 1.2},
}


def split_sizes(numel: int) -> list[int]:
    """A transformer-like mix: a few large matrices, medium ones and small norm vectors."""
    if numel < 1024:
        return [numel]
    sizes = [numel // 4, numel // 4, numel // 8, numel // 8, numel // 16, numel // 16]
    sizes += [min(4096, numel // 512)] * 16  # norm-like vectors, at most 1/32 of the total
    sizes.append(numel - sum(sizes))
    return sizes


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def make(name: str, numel: int, device: torch.device) -> torch.optim.Optimizer:
    dtype, factory, _, placement = VARIANTS[name]
    where = torch.device("cpu") if placement == HOST else device
    # generated where they live: a 1e9-element CPU randn per tensor would dominate the run
    g = torch.Generator(device=where).manual_seed(0)
    params = [
        torch.nn.Parameter((torch.randn(n, generator=g, device=where) * 0.02).to(dtype))
        for n in split_sizes(numel)
    ]
    for p in params:
        p.grad = (torch.randn(p.numel(), generator=g, device=where) * 1e-3).to(dtype)
    opt = factory(params)
    opt.step()  # creates state (and compiles, on an accelerator); timed steps are steady state
    opt.step()
    return opt


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def kernels_used() -> dict[str, object]:
    """Which kernels the ``auto`` variants ran: per device type, whether ``torch.compile``
    worked (False: it failed and the eager engine stood in); whether the native CPU kernel
    built and passed its check (None: no variant needed it)."""
    native = native_kernel._KERNEL
    return {
        "compiled": {dev: fn is not None for dev, fn in compiled_kernel._COMPILED.items()},
        "native_cpu": (native[0] is not None) if native else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="", help="comma-separated names (default: by device)")
    parser.add_argument("--out", default="", help="also write the JSON to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = args.variants.split(",") if args.variants else None
    names = names or (CPU_DEFAULT if device.type == "cpu" else ACCEL_DEFAULT)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    names = [BASELINE, *[n for n in names if n != BASELINE]]
    load_start = os.getloadavg()[0]
    setup_start = time.perf_counter()
    src = torch.randn(args.numel, device=device)
    dst = torch.empty_like(src)
    optimizers = {name: make(name, args.numel, device) for name in names}
    setup_s = time.perf_counter() - setup_start
    best = {name: float("inf") for name in names}
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
    offload = "cpu_offload_adamw_bf16_params"
    extra = {}
    if offload in best and device.type != "cpu":
        for ref, key in (
            ("full_fp32_adamw_bf16_params", "offload_vs_resident"),
            ("host_update_bf16_params", "offload_vs_host_update"),
        ):
            if ref in best:
                extra[key] = round(best[offload] / best[ref], 3)
    result = {
        "bench": "optimizer_step",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "numel": args.numel,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "setup_s": round(setup_s, 1),
        "copy_GBps": round(copy_gbps, 2),
        "targets": TARGETS["cpu" if device.type == "cpu" else "accelerator"],
        **extra,
        "kernels": kernels_used(),
        "variants": variants,
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
