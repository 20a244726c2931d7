"""QLoRA (``model.quant=nf4``) against BF16 LoRA: peak RSS and step time, same model and tokens.

A random-init Qwen2-architecture model of about 136M parameters (``--hidden 1024
--layers 12 --intermediate 2816``, the bundled 512-token vocabulary, so the decoder's
Linear layers are nearly all of it) is built on the fly and saved as a BF16 Hugging Face
checkpoint (safetensors), as a QLoRA user's base would be. Each variant then trains in a
fresh process with ``tasks.sft`` (``model=hf_local``, LoRA on every projection,
``master_fp32_adamw``, packed sequences, the same data and seed), rounds interleaved:

* ``peak_rss_mb``: the process's peak RSS (``VmHWM``) over load and training;
* ``model_peak_rss_mb``: the same less the RSS after importing torch and transformers
  (what the model, its load and training add to the interpreter);
* ``device_peak_mb`` (``--device cuda``): the peak of memory allocated on the GPU;
* ``step_s``: the median ``step_time_s`` of the steps after the first two.

Prints one JSON object with the medians over ``--repeats`` rounds and the ratios
QLoRA / BF16 (goal on CPU: peak RSS <= 0.5x, step time <= 1.5x). The interpreter with
torch, transformers and bitsandbytes and a step's activations are the same for both and
do not shrink, nor do the adapters' FP32 masters and moments: the smaller the model, the
closer the ratio is to 1. docs/benchmarks.md runs the 136M default and 0.5B and 1.1B
models with activation checkpointing (``--layers 12`` and ``--layers 24``):

    .venv/bin/python scripts/bench/qlora.py [--repeats 3] [--steps 8] [--device cpu]
    .venv/bin/python scripts/bench/qlora.py --hidden 2048 --intermediate 5632 --layers 24 \
        --seq 128 --batch 1 --activation-checkpointing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MB = 2**20
VARIANTS = {"bf16_lora": [], "qlora_nf4": ["model.quant=nf4"]}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(overrides: list[str]) -> None:
    """Train one variant in this process; print its RSS figures and step times as JSON."""
    import torch  # the interpreter's baseline includes torch and transformers
    import transformers  # noqa: F401

    from tasks.sft import main

    baseline = _rss_kb("VmRSS")
    run_dir = Path([o for o in overrides if o.startswith("run.dir=")][0].split("=", 1)[1])
    sys.argv = ["tasks.sft", *overrides]
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    peak = _rss_kb("VmHWM")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
    print(json.dumps({"peak_kb": peak, "baseline_kb": baseline,
                      "device_peak_bytes": device_peak,
                      "step_s": [s["step_time_s"] for s in steps],
                      "loss": [s["loss"] for s in steps]}))  # fmt: skip


def save_base(out: Path, args: argparse.Namespace) -> int:
    """The random BF16 model as an HF checkpoint; returns its parameter count."""
    from veoptim.config.schema import ModelConfig
    from veoptim.data import load_tokenizer, special_token_ids
    from veoptim.models import build_model

    tokenizer = load_tokenizer()
    cfg = ModelConfig(
        dtype="bf16", hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 256, max_position_embeddings=args.seq,
    )  # fmt: skip
    model = build_model(cfg, len(tokenizer), special_token_ids(tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run_variant(name: str, base: Path, work: Path, args: argparse.Namespace, i: int) -> dict:
    overrides = [
        "model=hf_local", f"model.path={base}", "model.dtype=bf16", "lora.enabled=true",
        "lora.r=16", "optim=master_fp32_adamw", f"train.max_steps={args.steps}",
        f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
        f"data.max_seq_len={args.seq}", "data.packing=true", "scheduler.warmup_steps=1",
        "logging.progress=false", "logging.level=WARNING", "export.hf=false",
        "checkpoint.save_at_end=false", f"run.device={args.device}",
        f"run.dir={work / f'{name}_{i}'}",
        f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        *VARIANTS[name],
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(overrides)],
        capture_output=True, text=True, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--activation-checkpointing", action="store_true",
        help="both variants recompute activations (as QLoRA runs usually do): the weights, "
        "not the activations, then set the peak",
    )  # fmt: skip
    parser.add_argument(
        "--mmap-threshold", type=int, default=0,
        help="MALLOC_MMAP_THRESHOLD_ of both runs (bytes; 0: glibc's dynamic default)",
    )  # fmt: skip
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory(prefix="qlora_bench_") as tmp:
        work = Path(tmp)
        params = save_base(work / "base", args)
        os.sync()  # a run that reads the checkpoint while it is written back measures the disk
        rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for i in range(args.repeats):
            for name in VARIANTS:  # interleaved: both see the same machine load
                rounds[name].append(run_variant(name, work / "base", work, args, i))
    result: dict = {"benchmark": "qlora", "device": args.device, "params": params,
                    "activation_checkpointing": args.activation_checkpointing,
                    "malloc_mmap_threshold": args.mmap_threshold or "glibc default",
                    "tokens_per_step": args.batch * args.seq, "steps": args.steps,
                    "repeats": args.repeats}  # fmt: skip
    for name, runs in rounds.items():
        result[name] = {
            "peak_rss_mb": statistics.median(r["peak_kb"] for r in runs) / 1024,
            "model_peak_rss_mb": statistics.median(r["peak_kb"] - r["baseline_kb"] for r in runs)
            / 1024,
            "device_peak_mb": statistics.median(r["device_peak_bytes"] for r in runs) / MB,
            "step_s": statistics.median(s for r in runs for s in r["step_s"][2:]),
            "first_loss": runs[0]["loss"][0],
        }
    q, b = result["qlora_nf4"], result["bf16_lora"]
    keys = ["peak_rss_mb", "model_peak_rss_mb", "step_s"]
    keys += ["device_peak_mb"] if b["device_peak_mb"] else []
    result["ratio"] = {key: q[key] / b[key] for key in keys}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
