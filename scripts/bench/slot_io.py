"""Multi-LoRA slots: one slot's save/load time vs live slots, and a 16-slot vs 1-slot step.

Everything runs in this process on the CPU, with a dense Qwen2 (``--hidden`` /
``--layers`` / ``--intermediate``, head dim 64, ``model.dtype=bf16``), LoRA rank
``--rank`` on every targeted Linear and ``optim=full_fp32_adamw`` (BF16 adapters plus
FP32 masters and moments), the bundled SFT data, ``checkpoint.fsync=true``.

- I/O: one ``SlotTrainer`` per live-slot count (1, 4, 16), each built with
  ``lora.num_slots`` = that count and every slot created and trained one step, so
  "16 live" means 16 adapters in every layer and 16 optimizers with state. Then
  ``--repeats`` rounds over the three trainers (order rotated each round):
  ``save_slot(0, ..., with_optimizer=True)`` and ``load_slot(0, ..., load_optimizer=True)``
  of that save, its files evicted from the page cache first (``posix_fadvise(DONTNEED)``,
  this benchmark's files only). Figures are medians (and minima); ratios are 16-live /
  1-live.
- Step: in the 16-slot trainer, the same ``--rows`` examples (a seeded sample) once all
  tagged slot 0 and once spread over the 16 slots (row ``i`` -> slot ``i % 16``), so
  both batches hold the same tokens. ``train_step`` of each is timed, interleaved over
  ``--rounds`` rounds after ``--warmup`` rounds; each round also times
  ``forward_backward`` and the ``optim_step`` calls apart (one for the 1-slot batch,
  16 for the spread one). Figures are medians (and minima).

Prints one JSON line. Targets: save and load of one slot with 16 live slots <= 1.1x
with one live slot; the 16-slot ``train_step`` <= 1.3x the 1-slot one. Each adapted layer
runs all slots as one batched product pair either way, so the step ratio is mostly the
16 slots' optimizer steps (16x the parameters of one): it shrinks as the base model grows
against the adapters (``--hidden``) and as each slot gets more rows (``--rows``).

    .venv/bin/python scripts/bench/slot_io.py [--hidden 384] [--layers 4] [--rank 16] [--rows 64] [--repeats 15] [--rounds 9] [--threads N] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch
from checkpoint_io import evict  # the sibling benchmark's (run as a script from here)

from veoptim.data import IGNORE_INDEX, collate, load_sft_dataset
from veoptim.slots import SLOT_IDS, MultiLoRAConfig, SlotTrainer

HEAD_DIM = 64
LIVE_COUNTS = (1, 4, 16)
STEP_SLOTS = 16
CHECKPOINT_NAME = "bench"
LR = 1e-3
SAMPLE_SEED = 0
TARGET_IO_RATIO = 1.1
TARGET_STEP_RATIO = 1.3


# ----------------------------------------------------------------- utilities
def version_bytes(version_dir: Path) -> int:
    return sum(p.stat().st_size for p in version_dir.rglob("*") if p.is_file())


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def med(values: list[float]) -> float:
    return round(median(values), 4)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def build_config(args: argparse.Namespace, num_slots: int, run_dir: Path) -> MultiLoRAConfig:
    cfg = MultiLoRAConfig()
    cfg.run.dir = str(run_dir)
    cfg.run.device = "cpu"
    heads = args.hidden // HEAD_DIM
    cfg.model.hidden_size = args.hidden
    cfg.model.intermediate_size = args.intermediate
    cfg.model.num_hidden_layers = args.layers
    cfg.model.num_attention_heads = heads
    cfg.model.num_key_value_heads = max(1, heads // 2)
    cfg.model.dtype = "bf16"
    cfg.lora.num_slots = num_slots
    cfg.lora.r = args.rank
    cfg.lora.alpha = 2.0 * args.rank
    cfg.optim.name = "full_fp32_adamw"
    cfg.scheduler.name = "constant"
    cfg.scheduler.warmup_steps = 0
    cfg.train.max_steps = 1_000_000
    cfg.checkpoint.fsync = True
    return cfg


def sample_batch(trainer: SlotTrainer, rows: int) -> dict[str, torch.Tensor]:
    """``rows`` examples of the bundled data (seeded sample), collated; no slot ids yet."""
    cfg = trainer.cfg
    dataset = load_sft_dataset("", trainer.tokenizer, cfg.data.max_seq_len, False)
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    index = torch.randperm(len(dataset), generator=generator)[:rows].tolist()
    return collate([dataset[i] for i in index], trainer.tokenizer.pad_token_id)


def tagged(batch: dict[str, torch.Tensor], slots: int) -> dict[str, torch.Tensor]:
    """The batch with row ``i`` tagged slot ``i % slots``."""
    rows = batch["input_ids"].shape[0]
    return {**batch, SLOT_IDS: torch.arange(rows) % slots}


def build_live(args: argparse.Namespace, live: int, workdir: Path, rows: int) -> SlotTrainer:
    """A trainer of ``live`` slots, every one created and trained one step."""
    trainer = SlotTrainer.from_config(build_config(args, live, workdir / f"live_{live}"))
    for slot in range(live):
        trainer.create_slot(slot, lr=LR)
    trained = trainer.train_step(tagged(sample_batch(trainer, rows), live))
    assert sorted(trained) == list(range(live)), trained
    return trainer


# ----------------------------------------------------------------------- I/O
def measure_io(trainers: dict[int, SlotTrainer], repeats: int) -> dict[str, Any]:
    saves: dict[int, list[float]] = {n: [] for n in trainers}
    loads: dict[int, list[float]] = {n: [] for n in trainers}
    nbytes = 0
    counts = list(trainers)
    for r in range(repeats):
        for live in counts[r % len(counts) :] + counts[: r % len(counts)]:  # rotate the order
            trainer = trainers[live]
            seconds, version = timed(
                lambda t=trainer: t.save_slot(0, CHECKPOINT_NAME, with_optimizer=True)
            )
            saves[live].append(seconds)
            nbytes = version_bytes(version)
            evict(version)
            seconds, _ = timed(
                lambda t=trainer: t.load_slot(0, CHECKPOINT_NAME, load_optimizer=True)
            )
            loads[live].append(seconds)
    first, last = min(trainers), max(trainers)
    save_s = {str(n): med(v) for n, v in saves.items()}
    load_s = {str(n): med(v) for n, v in loads.items()}
    return {
        "slot_checkpoint_bytes": nbytes,
        "save_s": save_s,
        "load_s": load_s,
        "save_s_min": {str(n): round(min(v), 4) for n, v in saves.items()},
        "load_s_min": {str(n): round(min(v), 4) for n, v in loads.items()},
        "save_ratio_16_vs_1": ratio(median(saves[last]), median(saves[first])),
        "load_ratio_16_vs_1": ratio(median(loads[last]), median(loads[first])),
        "save_ratio_16_vs_1_of_mins": ratio(min(saves[last]), min(saves[first])),
        "load_ratio_16_vs_1_of_mins": ratio(min(loads[last]), min(loads[first])),
    }


# ---------------------------------------------------------------------- step
def measure_step(
    trainer: SlotTrainer, batch: dict[str, torch.Tensor], rounds: int, warmup: int
) -> dict[str, Any]:
    variants = {"one_slot": tagged(batch, 1), "sixteen_slots": tagged(batch, STEP_SLOTS)}
    times: dict[str, dict[str, list[float]]] = {
        name: {"train_step": [], "forward_backward": [], "optim_steps": []} for name in variants
    }
    for _ in range(warmup):
        for b in variants.values():
            trainer.train_step(b)
    for r in range(rounds):
        order = list(variants.items())
        if r % 2:  # alternate which variant runs first in a round
            order.reverse()
        for name, b in order:
            seconds, _ = timed(lambda b=b: trainer.train_step(b))
            times[name]["train_step"].append(seconds)
            seconds, losses = timed(lambda b=b: trainer.forward_backward(b))
            times[name]["forward_backward"].append(seconds)
            start = time.perf_counter()
            for slot in losses:
                trainer.optim_step(slot)
            times[name]["optim_steps"].append(time.perf_counter() - start)
    pad = trainer.tokenizer.pad_token_id
    rows_per_slot = torch.bincount(variants["sixteen_slots"][SLOT_IDS], minlength=STEP_SLOTS)
    one, many = times["one_slot"], times["sixteen_slots"]
    return {
        "rows": int(batch["input_ids"].shape[0]),
        "rows_per_slot_min_max": [int(rows_per_slot.min()), int(rows_per_slot.max())],
        "padded_seq_len": int(batch["input_ids"].shape[1]),
        "input_tokens": int((batch["input_ids"] != pad).sum()),
        "labelled_tokens": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
        "rounds": rounds,
        "warmup_rounds": warmup,
        "one_slot_s": {k: med(v) for k, v in one.items()},
        "sixteen_slots_s": {k: med(v) for k, v in many.items()},
        "one_slot_min_s": {k: round(min(v), 4) for k, v in one.items()},
        "sixteen_slots_min_s": {k: round(min(v), 4) for k, v in many.items()},
        "sixteen_slots_optim_step_per_slot_s": round(median(many["optim_steps"]) / STEP_SLOTS, 5),
        "train_step_ratio_16_vs_1": ratio(median(many["train_step"]), median(one["train_step"])),
        "train_step_ratio_16_vs_1_of_mins": ratio(min(many["train_step"]), min(one["train_step"])),
        "forward_backward_ratio_16_vs_1": ratio(
            median(many["forward_backward"]), median(one["forward_backward"])
        ),
        "optim_steps_ratio_16_vs_1": ratio(median(many["optim_steps"]), median(one["optim_steps"])),
    }


def summarize(
    args: argparse.Namespace,
    workdir: Path,
    big: SlotTrainer,
    io: dict,
    step: dict,
    load_start: float,
) -> dict[str, Any]:
    m = big.cfg.model
    slot_params = sum(p.numel() for p in big.slots[0].params.parameters())
    all_params = sum(p.numel() for p in big.model.parameters())
    return {
        "bench": "slot_io",
        "dir": str(workdir),
        "model": {
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "num_hidden_layers": m.num_hidden_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads,
            "dtype": m.dtype,
            "base_params": all_params - slot_params * big.num_slots,
        },
        "lora_r": args.rank,
        "target_modules": list(big.cfg.lora.target_modules),
        "optimizer": "full_fp32_adamw (bf16 adapters, fp32 master + moments)",
        "slot_params": slot_params,
        "live_counts": list(LIVE_COUNTS),
        "live_slots": "a trainer per count, lora.num_slots = count, every slot trained",
        "repeats": args.repeats,
        "fsync": big.cfg.checkpoint.fsync,
        "page_cache": "per-file posix_fadvise(DONTNEED) before every timed load",
        **io,
        "step": step,
        "targets": {
            "save_ratio_16_vs_1": f"<= {TARGET_IO_RATIO}",
            "load_ratio_16_vs_1": f"<= {TARGET_IO_RATIO}",
            "train_step_ratio_16_vs_1": f"<= {TARGET_STEP_RATIO}",
        },
        "targets_met": {
            "save_ratio_16_vs_1": io["save_ratio_16_vs_1"] <= TARGET_IO_RATIO,
            "load_ratio_16_vs_1": io["load_ratio_16_vs_1"] <= TARGET_IO_RATIO,
            "train_step_ratio_16_vs_1": step["train_step_ratio_16_vs_1"] <= TARGET_STEP_RATIO,
        },
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "torch_threads": args.threads or "default",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=384, help="model.hidden_size (x64)")
    parser.add_argument("--intermediate", type=int, default=1024, help="model.intermediate_size")
    parser.add_argument("--layers", type=int, default=4, help="model.num_hidden_layers")
    parser.add_argument("--rank", type=int, default=16, help="lora.r (alpha = 2r)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the step batch (>= 16)")
    parser.add_argument("--repeats", type=int, default=15, help="timed saves / loads per count")
    parser.add_argument("--rounds", type=int, default=9, help="timed step rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed step rounds first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--dir", default=None, help="parent of the work dir (default: temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()
    if args.hidden % HEAD_DIM or args.rows < STEP_SLOTS:
        parser.error(f"--hidden must be a multiple of {HEAD_DIM} and --rows >= {STEP_SLOTS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="veoptim-slot-bench-", dir=args.dir))
    load_start = os.getloadavg()[0]  # other jobs on the machine skew every figure
    trainers: dict[int, SlotTrainer] = {}
    try:
        for live in LIVE_COUNTS:
            trainers[live] = build_live(args, live, workdir, args.rows)
        io = measure_io(trainers, args.repeats)
        big = trainers[STEP_SLOTS]
        step = measure_step(big, sample_batch(big, args.rows), args.rounds, args.warmup)
        print(json.dumps(summarize(args, workdir, big, io, step, load_start)))
    finally:
        for trainer in trainers.values():
            trainer.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
