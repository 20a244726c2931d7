"""veoptim vs TRL's ``SFTTrainer`` on identical tokens: tokens/s, peak RSS, share of BF16 peak.

Both sides train the same model from the same initial weights (``build_model`` of the
composed config; TRL gets an FP32 copy and trains it under BF16 autocast, veoptim trains
BF16 parameters with FP32 masters), on the same examples in the same order (veoptim's
sampler draws each step's global batch; TRL reads them as a pre-tokenized dataset in that
order with ``train_sampling_strategy="sequential"``), with the same tokenizer, the same
micro-batches and accumulation, the same clip and the same LR at every step (veoptim's
scheduler drives TRL's fused ``torch.optim.AdamW`` too).

That the two compute the same thing is checked, not assumed: a verification run in FP32
(``model.dtype=fp32``, ``optim=adamw``: torch's fused AdamW on both sides) compares the
first ``--verify-steps`` losses (relative difference <= 1e-5) and the LRs; the JSON says
``verified`` and the script exits 3 when they disagree. ``--control`` adds a negative
control: TRL once more without the clip, which the comparison must reject (else exit 3). Then alternating pairs, each run a
fresh process (its own peak RSS, ``VmHWM``), on the bundled tiny model and on a Qwen2 of
26 M parameters built on the fly. The BF16 matmul peak (a 2048^3 product, same threads) is
measured before and after the pairs; a run's share of it is
``6 x matmul parameters x tokens/s / peak`` (attention scores not counted).

    .venv/bin/python scripts/bench/peer_trl.py [--models tiny,qwen2_26m] [--pairs 3]
        [--steps 6] [--global-batch 64] [--micro-batch 16] [--threads 1] [--out FILE]
    .venv/bin/python scripts/bench/peer_trl.py --smoke   # tiny sizes, a few steps (the test)

TRL is an optional dependency: ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: Models: config overrides over the bundled tiny preset.
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "qwen2_26m": [
        "model.hidden_size=512",
        "model.intermediate_size=1600",
        "model.num_hidden_layers=8",
        "model.num_attention_heads=8",
        "model.num_key_value_heads=4",
    ],
}
#: veoptim's variants: extra config overrides. ``veoptim_eager`` is the baseline.
VEOPTIM_VARIANTS: dict[str, list[str]] = {
    "veoptim_eager": [],
    "veoptim": [
        "data.padding_free=true",
        "model.attn_implementation=sdpa_varlen",
        "train.micro_batch_tokens=8192",
    ],
    "veoptim_compiled": [
        "data.padding_free=true",
        "model.attn_implementation=sdpa_varlen",
        "train.micro_batch_tokens=8192",
        "model.compile=true",
    ],
}
#: TRL's variants: extra SFTConfig fields. ``trl_padding_free`` is its own padding-free
#: collation (one row per micro-batch, transformers' sdpa masking it block-diagonally).
TRL_VARIANTS: dict[str, dict[str, Any]] = {"trl": {}, "trl_padding_free": {"padding_free": True}}
LOSS_RTOL = 1e-5
VERIFY_FAILED_EXIT = 3


# ------------------------------------------------------------------ the two sides
def compose(spec: dict[str, Any], extra: list[str]) -> Any:
    """The veoptim config of ``spec`` (model, dtype, batch sizes, steps) plus ``extra``."""
    from tasks.compose import compose_config
    from veoptim.config import to_config

    fp32 = spec["dtype"] == "fp32"
    overrides = [
        "run.device=cpu",
        f"run.dir={spec['run_dir']}",
        "logging.progress=false",
        f"train.max_steps={spec['warmup'] + spec['steps']}",
        f"train.global_batch_size={spec['global_batch']}",
        f"train.micro_batch_size={spec['micro_batch']}",
        f"model.dtype={spec['dtype']}",
        "optim=adamw" if fp32 else "optim=master_fp32_adamw",
        *MODELS[spec["model"]],
        *extra,
    ]
    return to_config(compose_config("sft", overrides))


def matmul_params(model: Any) -> int:
    """Parameters of the Linear layers (LM head included): the FLOPs-per-token count."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def weights_hash(model: Any) -> str:
    """Content hash of the initial weights in FP32 (what both sides start from)."""
    from veoptim.content_hash import state_content_hash

    return state_content_hash({k: v.float() for k, v in model.state_dict().items()})


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_veoptim(spec: dict[str, Any]) -> dict[str, Any]:
    """Trainer.train_step, ``warmup`` steps untimed, then ``steps`` timed."""
    from veoptim.distributed import init_distributed
    from veoptim.trainer import Trainer

    cfg = compose(spec, VEOPTIM_VARIANTS[spec["variant"]])
    trainer = Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))
    initial = weights_hash(trainer.model) if spec["hash"] else ""
    trainer.model.train()
    losses, lrs, tokens = [], [], []
    start = 0.0
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            start = time.perf_counter()
        before = trainer.progress.tokens_seen
        metrics = trainer.train_step()
        losses.append(metrics["loss"])
        lrs.append(metrics["lr"])
        tokens.append(trainer.progress.tokens_seen - before)
    seconds = time.perf_counter() - start
    return result(spec, trainer.model, initial, losses, lrs, tokens, seconds)


def result(spec, model, initial, losses, lrs, tokens, seconds) -> dict[str, Any]:
    timed = sum(tokens[spec["warmup"] :])
    return {
        "initial_weights": initial,
        "losses": losses,
        "lrs": lrs,
        "tokens_per_step": tokens,
        "timed_s": seconds,
        "tokens_per_s": timed / seconds if seconds else 0.0,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "matmul_params": matmul_params(model),
    }


def ordered_examples(cfg: Any, steps: int) -> tuple[Any, list[dict], list[int]]:
    """The tokenizer, the examples veoptim's sampler yields for ``steps`` steps (flattened,
    in micro-batch order) and each step's non-padding tokens."""
    from veoptim.trainer.startup import build_sampler, load_inputs

    inputs = load_inputs(cfg)
    sampler = build_sampler(cfg, inputs, dp_rank=0, dp_size=1)
    dataset = inputs.objective.dataset
    rows, tokens = [], []
    for _ in range(steps):
        step = [dataset[i] for micro in sampler.next_step() for i in micro]
        rows += [{k: v.tolist() for k, v in e.items()} for e in step]
        tokens.append(sum(len(e["input_ids"]) for e in step))
    return inputs.tokenizer, rows, tokens


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's SFTTrainer on veoptim's batches, FP32 weights (BF16 autocast in bf16 runs)."""
    import dataclasses

    import torch
    from datasets import Dataset
    from trl import SFTConfig

    from veoptim.data import special_token_ids
    from veoptim.models import build_model
    from veoptim.optim import build_scheduler

    cfg = compose(spec, [])
    total = spec["warmup"] + spec["steps"]
    accum = spec["global_batch"] // spec["micro_batch"]
    tokenizer, rows, tokens = ordered_examples(cfg, total)
    fp32 = dataclasses.replace(cfg.model, dtype="fp32")
    model = build_model(fp32, len(tokenizer), special_token_ids(tokenizer))
    initial = weights_hash(model) if spec["hash"] else ""
    optim = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=True,
    )
    scheduler = build_scheduler(optimizer, cfg.scheduler, total)
    args = SFTConfig(
        output_dir=spec["run_dir"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=accum,
        max_steps=total,
        max_grad_norm=cfg.train.grad_clip if spec["trl_clip"] else 0.0,
        bf16=spec["dtype"] == "bf16",
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        max_length=None,
        dataset_kwargs={"skip_prepare_dataset": True},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.train.seed,
        **TRL_VARIANTS[spec["variant"]],
    )
    trainer_cls, clock_cls = trl_classes()
    clock = clock_cls(optimizer, spec["warmup"])
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
        callbacks=[clock],
    )
    trainer.train()
    micro = trainer.micro_losses
    losses = [sum(micro[i * accum : (i + 1) * accum]) for i in range(total)]
    return result(spec, model, initial, losses, clock.lrs, tokens, clock.timed_s)


def trl_classes() -> tuple[type, type]:
    """An SFTTrainer that keeps each micro-batch's loss, and a callback that times the
    steps after the warm-up and records the LR each optimizer step used (TRL is optional:
    only a TRL child imports it)."""
    from transformers import TrainerCallback
    from trl import SFTTrainer

    class LossRecordingSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            value = loss[0] if isinstance(loss, tuple) else loss
            self.__dict__.setdefault("micro_losses", []).append(float(value.detach().float()))
            return loss

    class StepClock(TrainerCallback):
        def __init__(self, optimizer: Any, warmup: int) -> None:
            self.optimizer, self.warmup = optimizer, warmup
            self.lrs: list[float] = []
            self.start = self.timed_s = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.lrs.append(self.optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.warmup:
                self.start = time.perf_counter()
            self.timed_s = time.perf_counter() - self.start

    return LossRecordingSFTTrainer, StepClock


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: the side and variant ``spec`` names."""
    import torch

    torch.set_num_threads(spec["threads"])
    return run_trl(spec) if spec["variant"] in TRL_VARIANTS else run_veoptim(spec)


# ------------------------------------------------------------------ the parent
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` in a fresh process (its own peak RSS); its last stdout line is the JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONPATH": str(REPO)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{spec['variant']} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bf16_matmul_peak_gflops(threads: int, size: int = 2048, repeats: int = 10) -> float:
    """Median GFLOP/s of a ``size``^3 BF16 matrix product on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / median(times) / 1e9


def relative_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=True)]


def verify(base: dict[str, Any], steps: int, control: bool) -> dict[str, Any]:
    """FP32 runs of both sides: the first ``steps`` losses, the LRs and the initial weights.

    With ``control``, TRL also runs once without the gradient clip, from the same weights
    and LRs: a negative control that the comparison must reject (``control.verified`` is
    false), which shows the verification can fail."""
    spec = {**base, "dtype": "fp32", "warmup": 0, "steps": steps, "hash": True}
    ours = run_child({**spec, "variant": "veoptim_eager"})
    check = compare(ours, run_child({**spec, "variant": "trl", "trl_clip": True}))
    if control:
        check["control"] = compare(ours, run_child({**spec, "variant": "trl", "trl_clip": False}))
    return check


def compare(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Whether two FP32 runs trained the same thing, and the figures that say so."""
    diffs = relative_diffs(ours["losses"], peer["losses"])
    checks = {
        "losses_agree": max(diffs) <= LOSS_RTOL,
        "lrs_equal": ours["lrs"] == peer["lrs"],
        "initial_weights_equal": ours["initial_weights"] == peer["initial_weights"],
        "tokens_equal": ours["tokens_per_step"] == peer["tokens_per_step"],
    }
    return {
        "verified": all(checks.values()),
        **checks,
        "loss_rtol": LOSS_RTOL,
        "max_rel_loss_diff": max(diffs),
        "losses": {"veoptim": ours["losses"], "trl": peer["losses"]},
        "lrs": {"veoptim": ours["lrs"], "trl": peer["lrs"]},
    }


def verification_failed(check: dict[str, Any]) -> bool:
    """The comparison rejected the real pair, or (with a control) accepted the control."""
    return not check["verified"] or check.get("control", {}).get("verified", False)


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(median(values), 4),
        "range": [round(min(values), 4), round(max(values), 4)],
    }


def pairs(base: dict[str, Any], variants: list[str], n: int) -> dict[str, Any]:
    """``n`` rounds of every variant, the order reversed every other round."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_ in range(n):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            runs[variant].append(run_child({**base, "variant": variant, "hash": False}))
    flops_per_token = 6 * runs[variants[0]][0]["matmul_params"]
    out: dict[str, Any] = {"flops_per_token": flops_per_token, "runs": {}, "vs_trl": {}}
    for variant, results in runs.items():
        rates = [r["tokens_per_s"] for r in results]
        out["runs"][variant] = {
            "tokens_per_s": [round(x, 1) for x in rates],
            "peak_rss_mb": [r["peak_rss_mb"] for r in results],
            "losses_last_run": [round(x, 6) for x in results[-1]["losses"]],
        }
    for variant in runs:
        for peer in TRL_VARIANTS:
            if variant in TRL_VARIANTS or peer not in runs:
                continue
            ours, theirs = runs[variant], runs[peer]
            out["vs_trl"][f"{variant}/{peer}"] = {
                "tokens_per_s": spread(
                    [
                        a["tokens_per_s"] / b["tokens_per_s"]
                        for a, b in zip(ours, theirs, strict=True)
                    ]
                ),
                "peak_rss": spread(
                    [a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(ours, theirs, strict=True)]
                ),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen2_26m")
    parser.add_argument("--variants", default="veoptim_eager,veoptim,trl,trl_padding_free")
    parser.add_argument("--pairs", type=int, default=3, help="0: the verification only")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--verify-steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument(
        "--control",
        action="store_true",
        help="also verify TRL without the gradient clip, which the check must reject",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 pair of 2 steps")
    parser.add_argument("--out", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.smoke:
        args.models, args.pairs, args.steps, args.warmup = "tiny", 1, 2, 1
        args.global_batch, args.micro_batch = 8, 4
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VEOPTIM_VARIANTS and v not in TRL_VARIANTS]
    if unknown:
        raise SystemExit(
            f"--variants: unknown {unknown}; known: {[*VEOPTIM_VARIANTS, *TRL_VARIANTS]}"
        )
    import torch
    import transformers
    import trl

    load_start = os.getloadavg()[0]
    peak_before = bf16_matmul_peak_gflops(args.threads)
    report: dict[str, Any] = {
        "bench": "peer_trl",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "pairs": args.pairs,
        "dtype": args.dtype,
        "models": {},
    }
    failed = False
    with tempfile.TemporaryDirectory(prefix="veoptim-peer-") as tmp:
        for name in args.models.split(","):
            base = {
                "model": name,
                "run_dir": str(Path(tmp) / name),
                "global_batch": args.global_batch,
                "micro_batch": args.micro_batch,
                "threads": args.threads,
                "dtype": args.dtype,
                "warmup": args.warmup,
                "steps": args.steps,
                "trl_clip": True,
            }
            check = verify(base, args.verify_steps, control=args.control)
            failed |= verification_failed(check)
            report["models"][name] = {"verify_fp32": check}
            if args.pairs:
                report["models"][name].update(pairs(base, variants, args.pairs))
    peak_after = bf16_matmul_peak_gflops(args.threads)
    report["bf16_matmul_peak_gflops"] = {
        "before": round(peak_before, 1),
        "after": round(peak_after, 1),
        "used": round(max(peak_before, peak_after), 1),
    }
    peak = max(peak_before, peak_after)
    for model in report["models"].values():
        for run in model.get("runs", {}).values():
            fractions = [x * model["flops_per_token"] / (peak * 1e9) for x in run["tokens_per_s"]]
            run["bf16_peak_fraction"] = spread(fractions)
    report["loadavg_1min_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    line = json.dumps(report)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    if failed:
        sys.exit(VERIFY_FAILED_EXIT)


if __name__ == "__main__":
    main()
