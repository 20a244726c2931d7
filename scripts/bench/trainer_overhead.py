"""Trainer overhead: tokens/s of the veoptim Trainer vs a minimal hand-written loop.

Both run the same model, data, batches and optimizer in this process, interleaved
in rounds so that machine noise hits both alike. Prints one JSON line; the
target is ``ratio >= 0.95``.

    .venv/bin/python scripts/bench/trainer_overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tasks.compose import compose_config
from veoptim.config import to_config
from veoptim.data import collate
from veoptim.distributed import init_distributed
from veoptim.objectives import summed_token_loss
from veoptim.trainer import Trainer


def build_trainer(steps: int) -> Trainer:
    overrides = ["run.device=cpu", f"train.max_steps={steps}", "logging.progress=false"]
    cfg = to_config(compose_config("sft", overrides))
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def time_trainer(trainer: Trainer, steps: int) -> tuple[float, int]:
    """Seconds and input tokens of ``steps`` Trainer.train_step calls."""
    tokens_before = trainer.progress.tokens_seen
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return time.perf_counter() - start, trainer.progress.tokens_seen - tokens_before


def time_minimal_loop(trainer: Trainer, steps: int) -> tuple[float, int]:
    """The same work as a hand-written loop: collate, forward, loss, backward, step."""
    model, opt, sched = trainer.model, trainer.optimizer, trainer.scheduler
    dataset, sampler = trainer.objective.dataset, trainer.sampler
    pad_id = trainer.tokenizer.pad_token_id
    tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        micro = [collate([dataset[i] for i in mb], pad_id) for mb in sampler.next_step()]
        tokens += sum(int((b["input_ids"] != pad_id).sum()) for b in micro)
        n_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        for b in micro:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            logits = model(**inputs, use_cache=False).logits
            (summed_token_loss(logits, b["labels"]) / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trainer = build_trainer(steps=10_000)
    trainer.model.train()
    for _ in range(3):  # warm-up (allocator, first-call overheads)
        trainer.train_step()
    t_trainer = t_loop = 0.0
    n_trainer = n_loop = 0
    for _ in range(args.rounds):
        seconds, tokens = time_trainer(trainer, args.steps)
        t_trainer, n_trainer = t_trainer + seconds, n_trainer + tokens
        seconds, tokens = time_minimal_loop(trainer, args.steps)
        t_loop, n_loop = t_loop + seconds, n_loop + tokens
    steps = args.steps * args.rounds
    print(
        json.dumps(
            {
                "bench": "trainer_overhead",
                "steps_each": steps,
                "trainer_tokens_per_s": n_trainer / t_trainer,
                "minimal_loop_tokens_per_s": n_loop / t_loop,
                "ratio": (n_trainer / t_trainer) / (n_loop / t_loop),
                "target": ">= 0.95",
            }
        )
    )


if __name__ == "__main__":
    main()
