"""Multi-LoRA demo: ``python -m tasks.multi_lora [key=value ...]`` (or under torchrun).

One frozen base and one LoRA slot per task of ``data.tasks`` (a task is the prefix of
its user prompts in the SFT data), trained concurrently: every step is one batch mixing
``train.micro_batch_size`` rows of each slot per rank. Halfway, slot 0 is saved and loaded
into the spare slot after the tasks' slots, and the copy must continue exactly like the
original: the same state bit for bit, then again after one step of each on the same rows.
At the end every task slot is exported as a PEFT adapter directory.

Like every task, the run dir gets the resolved ``config.yaml`` and a ``metrics.jsonl``
(``callbacks/run_files.py``, ``callbacks/metrics.py``): one record per task slot at each
logged step (``logging.log_every`` and the last), with the slot's step, ``slot``, ``task``,
``loss``, ``lr``, ``grad_norm`` and ``tokens``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from veoptim.config import prefer_explicit, to_config
from veoptim.data import bundled_dataset_path, collate
from veoptim.data.records import Conversation, read_conversations
from veoptim.data.sft import report_truncation, tokenize_conversations
from veoptim.distributed import DistContext, init_distributed, setup_logging
from veoptim.errors import ConfigError, DataError, VeoptimError
from veoptim.rundir import locked_run_dir
from veoptim.slots import SLOT_IDS, MultiLoRAConfig, SlotTrainer

from .cli import task_command
from .runner import job_overrides, run_dir_of_job

if __package__ == "veoptim.tasks":  # installed (setup.py); the checkout's are top-level
    from veoptim.callbacks.metrics import append_metrics, prepare_metrics_file
    from veoptim.callbacks.run_files import write_resolved_config
else:
    from callbacks.metrics import append_metrics, prepare_metrics_file
    from callbacks.run_files import write_resolved_config

NAME = "multi_lora"
#: What must be bitwise equal between slot 0 and its copy (keys of ``slot_state``).
COMPARED = ("weights", "master_weight", "exp_avg", "exp_avg_sq", "step", "param_groups",
            "scheduler", "spec", "steps")  # fmt: skip
log = logging.getLogger("veoptim")


def split_tasks(cfg: MultiLoRAConfig) -> tuple[Path, list[list[Conversation]]]:
    """The conversations of each task: those whose first user prompt starts with it."""
    path = Path(cfg.data.train_path) if cfg.data.train_path else bundled_dataset_path()
    conversations = read_conversations(path)

    def prompt(c: Conversation) -> str:
        return next((m["content"] for m in c.messages if m["role"] == "user"), "")

    split = [[c for c in conversations if prompt(c).startswith(task)] for task in cfg.data.tasks]
    for task, matched in zip(cfg.data.tasks, split, strict=True):
        if not matched:
            raise DataError(
                f"data.tasks: no user prompt in {path} starts with {task!r}; a task is the "
                "prefix of its slot's prompts (e.g. 'data.tasks=[Uppercase,Reverse]')."
            )
    return path, split


def mixed_batch(t: SlotTrainer, data: Sequence[list], slots: Sequence[int], rows: int,
                gen: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    """``rows`` examples drawn from each slot's task (this rank's draw), tagged with the slot."""
    examples, ids = [], []
    for s in slots:
        examples += [data[s][i] for i in torch.randint(len(data[s]), (rows,), generator=gen)]
        ids += [s] * rows
    batch = collate(examples, t.tokenizer.pad_token_id)
    batch[SLOT_IDS] = torch.tensor(ids)
    return batch


def differences(a: Any, b: Any, where: str) -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bit for bit, containers element by element."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        bits = [x.reshape(-1).view(torch.uint8) for x in (a, b)]
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
        return [] if same else [where]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return [f"{where} (keys: {len(a)} vs {len(b)}, {len(a.keys() ^ b.keys())} unmatched)"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where} ({a!r:.80} != {b!r:.80})"]


def compare_slots(t: SlotTrainer, s: int, copy: int) -> list[str]:
    a, b = t.slot_state(s), t.slot_state(copy)
    return [d for key in COMPARED for d in differences(a[key], b[key], key)]


class SlotMetrics:
    """Rank 0's ``metrics.jsonl`` of the task slots: a record per slot at each logged step."""

    def __init__(self, path: Path | None, tasks: Sequence[str], cfg: MultiLoRAConfig) -> None:
        self.path, self.tasks = path, list(tasks)
        self.log_every, self.last_step = cfg.logging.log_every, cfg.schedule_steps
        if path is not None:
            prepare_metrics_file(path, resumed_step=0)  # a fresh run: an earlier file moves aside

    def step_end(self, slot: int, step: int, result: Mapping[str, float]) -> None:
        """Slot ``slot`` finished its ``step``-th step (``SlotTrainer.train_step``'s result)."""
        if self.path is None or not (step % self.log_every == 0 or step == self.last_step):
            return
        record = {"step": step, "slot": slot, "task": self.tasks[slot]}
        record.update({k: result[k] for k in ("loss", "lr", "grad_norm", "tokens")})
        append_metrics(self.path, record)


def check_continuation(t: SlotTrainer, data: Sequence[list], copy: int, rows: int,
                       gen: torch.Generator, losses: dict[int, list[float]],
                       metrics: SlotMetrics) -> bool:  # fmt: skip
    """Save slot 0, load it into ``copy``, compare; one step of each on the same rows, compare."""
    t.save_slot(0, "task0", with_optimizer=True)
    t.load_slot(copy, "task0", load_optimizer=True)
    state = t.slot_state(0)
    counts = ", ".join(f"{k} {len(state[k])}" for k in COMPARED[:5])
    diffs = [f"after load: {d}" for d in compare_slots(t, 0, copy)]
    batch = mixed_batch(t, data, [0], rows, gen)
    original = t.forward_backward(batch)[0]
    stepped = t.optim_step(0)
    batch[SLOT_IDS] = torch.full_like(batch[SLOT_IDS], copy)
    continued = t.forward_backward(batch)[copy]
    t.optim_step(copy)
    losses[0].append(original.loss)  # a training step of slot 0 like any other
    metrics.step_end(
        0, len(losses[0]), {"loss": original.loss, "tokens": original.tokens, **stepped}
    )
    if original != continued:
        diffs.append(f"identical step: loss {original} != {continued}")
    diffs += [f"after one identical step: {d}" for d in compare_slots(t, 0, copy)]
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 8 else "")
        log.error("exact continuation: FAILED: slot %d differs from slot 0: %s", copy, shown)
        return False
    log.info("exact continuation: OK (slot %d = slot 0 bitwise after load and after one identical "
             "step, loss %.6f; tensors compared: %s)", copy, original.loss, counts)  # fmt: skip
    return True


def train_rounds(t: SlotTrainer, cfg: MultiLoRAConfig, data: Sequence[list], steps: range,
                 gen: torch.Generator, losses: dict[int, list[float]],
                 metrics: SlotMetrics) -> None:  # fmt: skip
    """Round ``k`` trains every task slot that has fewer than ``k`` steps, in one batch."""
    for step in steps:
        slots = [s for s in losses if len(losses[s]) < step]
        if slots:
            results = t.train_step(mixed_batch(t, data, slots, cfg.train.micro_batch_size, gen))
            for s, result in results.items():
                losses[s].append(result["loss"])
                metrics.step_end(s, len(losses[s]), result)
        if step % cfg.logging.log_every == 0 or step == cfg.schedule_steps:
            per_slot = "  ".join(f"slot{s} {losses[s][step - 1]:.4f}" for s in losses)
            log.info("step %d/%d  loss %s", step, cfg.schedule_steps, per_slot)


def run(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> bool:
    """The whole demo; False when the exact-continuation check failed."""
    cfg = cfg.copy()
    cfg.run.dir = run_dir_of_job(cfg)
    prefer_explicit(cfg, job_overrides())  # e.g. a warmup_ratio replaces the preset's steps
    config = to_config(cfg)
    assert isinstance(config, MultiLoRAConfig)
    tasks, max_steps = list(config.data.tasks), config.schedule_steps
    if not tasks or config.lora.num_slots <= len(tasks):
        raise ConfigError(
            f"lora.num_slots ({config.lora.num_slots}) must exceed the number of data.tasks "
            f"({len(tasks)}): one slot per task plus a spare for the save/load check."
        )
    path, conversations = split_tasks(config)
    # The slot trainer lives only in _run_slots' frame, so closing the context can free the
    # process groups it holds (see DistContext.close).
    with init_distributed(config.run.device, config.parallel.backend, env) as ctx:
        with locked_run_dir(config.run.dir, "this run"):  # one writer of the run dir
            return _run_slots(config, ctx, tasks, max_steps, path, conversations)


def _run_slots(
    config: MultiLoRAConfig,
    ctx: DistContext,
    tasks: list[str],
    max_steps: int,
    path: Path,
    conversations: list[list[Conversation]],
) -> bool:
    setup_logging(ctx, config.logging.level, config.logging.progress)
    t = SlotTrainer.from_config(config, ctx)
    run_dir = Path(config.run.dir)
    if ctx.is_main:
        resolved = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
        write_resolved_config(run_dir, resolved)
    metrics = SlotMetrics(
        run_dir / config.logging.metrics_file if ctx.is_main else None, tasks, config
    )
    data = []
    max_len = config.data.max_seq_len
    for task, convs in zip(tasks, conversations, strict=True):
        examples, cut = tokenize_conversations(convs, t.tokenizer, max_len, path)
        report_truncation(cut, len(examples), max_len, path)
        data.append(examples)
        log.info("slot %d: task %r, %d examples", len(data) - 1, task, len(examples))
    for s in range(len(tasks)):
        t.create_slot(s, lr=config.optim.lr, r=config.lora.r, alpha=config.lora.alpha)
    gen = torch.Generator().manual_seed(config.train.seed * ctx.world_size + ctx.rank)
    losses: dict[int, list[float]] = {s: [] for s in range(len(tasks))}
    log.info("training %d slots for %d steps each on %s x%d; run dir %s",
             len(tasks), max_steps, ctx.device, ctx.world_size, config.run.dir)  # fmt: skip
    train_rounds(t, config, data, range(1, max_steps // 2 + 1), gen, losses, metrics)
    rows = config.train.micro_batch_size
    if not check_continuation(t, data, len(tasks), rows, gen, losses, metrics):
        return False
    train_rounds(t, config, data, range(max_steps // 2 + 1, max_steps + 1), gen, losses, metrics)
    for s, task in enumerate(tasks):
        slug = re.sub(r"[^a-z0-9]+", "-", task.lower()).strip("-") or "task"
        exported = t.export_slot(s, f"slot{s}_{slug}")
        tail = losses[s][-config.logging.log_every :]
        log.info("slot %d (%r): loss first %.4f, last %.4f (mean of the last %d: %.4f) "
                 "over %d steps; PEFT adapter %s", s, task, losses[s][0], losses[s][-1],
                 len(tail), sum(tail) / len(tail), len(losses[s]), exported)  # fmt: skip
    log.info("exports under %s", t.exports_root)
    return True


def job(cfg: DictConfig) -> None:
    try:
        ok = run(cfg)
    except VeoptimError as error:
        log.error("%s: %s", type(error).__name__, error)
        sys.exit(2)
    if not ok:
        sys.exit(1)


main = task_command(NAME, MultiLoRAConfig, job)


if __name__ == "__main__":
    main()
