"""The real ``Trainer`` normalises the loss by the *global* count of response tokens.

One ``Trainer.train_step`` on 2 gloo ranks (FSDP2, FP32 compute) must give the loss, the
gradient norm and the gradients of one ``Trainer.train_step`` in a single process on the
same global batch, although the two ranks' shares hold different numbers of response
tokens. The negative control divides by this rank's count times the rank count (a mean
of per-rank means, exact only for equal counts) and must be detected.

One spawn runs both cases (process start dominates). Tolerances, as in
``test_multirank.py``: loss and grad norm within 2e-5 absolute, gradients (after clipping,
as the optimizer sees them) within 1e-5 of the largest one (measured: loss 0, grad norm
5e-7, gradients 1.3e-7); the differences come only from summation order. The negative
control is off by 5e-3 in the loss and 0.29 in the gradients (response tokens 5 vs 10).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.checkpoint.ckpt_state import build_trainer
from tests.distributed.spawn import run_ranks
from veoptim.distributed import DistContext
from veoptim.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

OVERRIDES = ["model.dtype=fp32", "parallel.param_dtype=fp32", "checkpoint.fsync=false"]
LOSS_TOL = 2e-5
GRAD_REL_TOL = 1e-5
CASES = ("global", "per_rank_mean")


def capture_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full copies of the gradients the optimizer steps with (collective on every rank)."""
    grads: dict[str, torch.Tensor] = {}

    def hook(*_: Any) -> None:
        for name, param in trainer.model.named_parameters():
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()

    trainer.optimizer.register_step_pre_hook(hook)
    return grads


def count_normalisers(trainer: Trainer) -> list[int]:
    """Record this rank's normaliser (response tokens) per micro-batch."""
    counts: list[int] = []
    micro_batch = trainer.objective.micro_batch

    def counting(indices: list[int]):
        batch = micro_batch(indices)
        counts.append(batch.normaliser)
        return batch

    trainer.objective.micro_batch = counting  # type: ignore[method-assign]
    return counts


def divide_by_per_rank_count(trainer: Trainer) -> None:
    """Negative control: the step's first reduction (the counts) returns this rank's counts
    times the rank count instead of the sum over ranks."""
    plan, reduce = trainer.plan, trainer.plan.all_reduce_sum
    calls = []

    def wrong(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x.detach().clone() * plan.dp_size if len(calls) == 1 else reduce(x)

    plan.all_reduce_sum = wrong  # type: ignore[method-assign]


def one_step(trainer: Trainer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    counts = count_normalisers(trainer)
    grads = capture_grads(trainer)
    metrics = trainer.train_step()
    step = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "counts": sum(counts)}
    return step, grads


def two_rank_steps(ctx: DistContext, out: Path) -> dict[str, Any]:
    """Rank function: each case's step on 2 ranks; rank 0 saves the full gradients."""
    results: dict[str, Any] = {}
    for case in CASES:
        trainer = build_trainer(out / case, OVERRIDES, ctx)
        if case == "per_rank_mean":
            divide_by_per_rank_count(trainer)
        step, grads = one_step(trainer)
        per_rank = [torch.zeros((), dtype=torch.long) for _ in range(ctx.world_size)]
        dist.all_gather(per_rank, torch.tensor(step.pop("counts")))
        step["rank_counts"] = [int(c) for c in per_rank]
        step["dp_size"] = trainer.plan.dp_size
        if ctx.is_main:
            torch.save(grads, out / f"{case}.grads.pt")
        results[case] = step
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trainer_two_ranks")
    results = run_ranks(2, two_rank_steps, out)
    reference, ref_grads = one_step(build_trainer(out / "single", OVERRIDES))
    grads = {case: torch.load(out / f"{case}.grads.pt", weights_only=True) for case in CASES}
    return {"two": results, "single": reference, "ref_grads": ref_grads, "grads": grads}


def grad_rel_diff(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(grads) == sorted(ref)
    scale = max(g.abs().max().item() for g in ref.values())
    return max((grads[n] - g).abs().max().item() for n, g in ref.items()) / scale


def test_ranks_hold_unequal_response_token_counts(runs):
    two = runs["two"]["global"]
    assert two["dp_size"] == 2
    assert two["rank_counts"][0] != two["rank_counts"][1], two  # else the control is blind
    assert sum(two["rank_counts"]) == runs["single"]["counts"]  # the same global batch


def test_two_rank_step_matches_one_process(runs):
    two, single = runs["two"]["global"], runs["single"]
    assert abs(two["loss"] - single["loss"]) < LOSS_TOL, (two, single)
    assert abs(two["grad_norm"] - single["grad_norm"]) < LOSS_TOL, (two, single)
    assert grad_rel_diff(runs["grads"]["global"], runs["ref_grads"]) < GRAD_REL_TOL


def test_per_rank_normaliser_is_detected(runs):
    """Negative control: a mean of per-rank means changes loss and gradients."""
    wrong, single = runs["two"]["per_rank_mean"], runs["single"]
    assert abs(wrong["loss"] - single["loss"]) > 100 * LOSS_TOL, (wrong, single)
    assert grad_rel_diff(runs["grads"]["per_rank_mean"], runs["ref_grads"]) > 100 * GRAD_REL_TOL
