"""Evaluation: the objective's loss over a fixed eval set, exact on any number of ranks.

Each data-parallel rank takes a disjoint contiguous slice of the eval examples; the
normalisers, loss sums and metric sums are all-reduced and divided once by the global
normaliser, the rule a training step's loss follows (``objective.py``), so the result is
the same on 1 or N ranks up to the order of float sums. Every rank runs the same number
of forwards (a rank whose slice is shorter repeats a batch and ignores it), because
sharded and expert-parallel forwards are collectives.

Evaluation runs in eval mode under ``torch.no_grad`` and restores the train mode and
every RNG state afterwards; it never touches the sampler. So a run with evaluation
trains bitwise like one without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from veoptim.data.holdout import Holdout
from veoptim.distributed.sizes import rank_slice
from veoptim.errors import DataError
from veoptim.state.rng import capture_rng, restore_rng
from veoptim.trainer.objective import Objective

if TYPE_CHECKING:
    from veoptim.config.schema import TrainerConfig
    from veoptim.distributed import ParallelPlan

#: Prefix of evaluation metrics in a step's metrics (metrics.jsonl, wandb; TensorBoard: eval/).
EVAL_PREFIX = "eval_"


@dataclass
class EvalSet:
    """The examples evaluated: ``indices`` into ``data``, whose ``micro_batch`` collates them
    (the training objective for a hold-out, a second objective over ``data.eval_path``)."""

    data: Objective
    indices: list[int]


def build_eval_set(
    cfg: TrainerConfig, tokenizer: Any, objective: Objective, holdout: Holdout
) -> EvalSet | None:
    """``data.eval_path`` read like the training file, or the hold-out; None without either."""
    if cfg.data.eval_path:
        data = cfg.build_eval_objective(tokenizer)
        if data.num_examples == 0:
            raise DataError(f"data.eval_path={cfg.data.eval_path} holds no examples.")
        return EvalSet(data, list(range(data.num_examples)))
    if holdout.eval:
        return EvalSet(objective, list(holdout.eval))
    return None


def forwards_per_rank(count: int, dp_size: int, micro_batch_size: int) -> int:
    """Micro-batches of the longest share: every rank runs this many forwards."""
    longest = -(-count // dp_size)
    return -(-longest // micro_batch_size)


def evaluate(
    model: torch.nn.Module,
    objective: Objective,
    eval_set: EvalSet,
    plan: ParallelPlan,
    device: torch.device,
    micro_batch_size: int,
) -> dict[str, float]:
    """Mean loss and metrics over the whole eval set (collective: call on every rank), as
    ``eval_<name>`` keys; which metrics is the objective's choice (``eval_metrics``).

    Micro-batches are collated one at a time (the eval set is never held in memory at
    once); the sums are divided by the global normaliser only after the all-reduce.
    """
    rng = capture_rng(device)
    count = len(eval_set.indices)
    mine = [eval_set.indices[i] for i in rank_slice(count, plan.dp_rank, plan.dp_size)]
    was_training = model.training
    model.eval()
    try:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        loss_sum, normaliser = zero.clone(), zero.clone()
        metric_sums: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i in range(forwards_per_rank(count, plan.dp_size, micro_batch_size)):
                indices = mine[i * micro_batch_size : (i + 1) * micro_batch_size]
                real = bool(indices)  # else a shorter share: repeat a batch, ignore its result
                batch = eval_set.data.micro_batch(indices or eval_set.indices[:1])
                out = objective.loss(model, {k: v.to(device) for k, v in batch.inputs.items()})
                if real:
                    loss_sum += out.total.double()
                    normaliser += batch.normaliser
                for name, value in out.metrics.items():
                    total = metric_sums.get(name, zero)
                    metric_sums[name] = total + value.double() if real else total
    finally:
        plan.reshard(model)
        model.train(was_training)
        restore_rng(rng, device)
    reduced = plan.all_reduce_sum(torch.stack([loss_sum, normaliser, *metric_sums.values()]))
    loss_total, global_normaliser, *sums = reduced.tolist()
    if global_normaliser == 0:
        raise DataError(f"the eval set has no {objective.normaliser_name} to evaluate.")
    metrics = {
        name: value / global_normaliser for name, value in zip(metric_sums, sums, strict=True)
    }
    loss = loss_total / global_normaliser
    report = getattr(objective, "eval_metrics", None)
    values = report(loss, metrics) if report is not None else {"loss": loss, **metrics}
    return {f"{EVAL_PREFIX}{name}": float(value) for name, value in values.items()}


def perplexity(token_loss: float) -> float:
    """``exp`` of a token-mean cross-entropy (inf rather than an overflow error)."""
    try:
        return math.exp(token_loss)
    except OverflowError:
        return math.inf
