"""Rank functions for the multi-rank tests: a minimal training loop and its single-process reference.

The loss contract is the trainer's: per micro-batch, ``sum of token losses /
global number of loss tokens`` (all-reduced over every rank and micro-batch).
Rows of the fixed global batch mask different numbers of tokens, so a mean of
per-rank means would give different gradients (the negative control).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from veoptim.config.schema import ModelConfig, ParallelConfig
from veoptim.distributed import DistContext, ParallelPlan, build_parallel_plan
from veoptim.models.build import build_model

VOCAB = 128
SEQ_LEN = 16
GLOBAL_BATCH = 8
MICRO_BATCHES = 2
STEPS = 3
LR = 1e-2
MAX_NORM = 1.0
IGNORE = -100
DCP_DIR = "dcp_model"
FULL_STATE_FILE = "full_state.pt"


def model_config(
    moe: bool, num_experts: int = 4, top_k: int = 2, arch: str = "qwen3_moe"
) -> ModelConfig:
    if not moe:
        return ModelConfig(arch="qwen2")
    return ModelConfig(
        arch=arch, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=32
    )


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed token ids and labels; row ``i`` masks its first ``2 * (i % 5)`` labels."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    labels = ids.clone()
    for i in range(GLOBAL_BATCH):
        labels[i, : 2 * (i % 5)] = IGNORE
    return ids, labels


def loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != IGNORE).sum()


def token_loss_sum(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(
    model: nn.Module,
    plan: ParallelPlan | None,
    ids: torch.Tensor,
    labels: torch.Tensor,
    per_rank_mean: bool = False,
) -> dict[str, Any]:
    """STEPS AdamW steps; returns the global losses, grad norms and the first step's full grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    reduce = plan.all_reduce_sum if plan is not None else (lambda x: x.clone())
    losses, norms, first_grads = [], [], {}
    for step in range(STEPS):
        # Negative control: a mean of per-rank means (equal only if every rank had as many loss tokens).
        count = loss_tokens(labels) * plan.dp_size if per_rank_mean else reduce(loss_tokens(labels))
        total = torch.zeros(())
        for mb_ids, mb_labels in zip(
            ids.chunk(MICRO_BATCHES), labels.chunk(MICRO_BATCHES), strict=True
        ):
            loss = token_loss_sum(model, mb_ids, mb_labels) / count
            loss.backward()
            total += loss.detach()
        losses.append(reduce(total).item())
        if step == 0:
            first_grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
        if plan is not None:
            norms.append(plan.clip_grad_norm_(model, MAX_NORM).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads": first_grads}


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Max absolute differences of losses, norms and first-step gradients (relative to the largest grad)."""
    grad_scale = max(g.abs().max().item() for g in ref["grads"].values())
    grad_diff = max((run["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
    return {
        "losses": run["losses"],
        "ref_losses": ref["losses"],
        "loss_diff": max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)),
        "norm_diff": max(abs(a - b) for a, b in zip(run["norms"], ref["norms"], strict=True)),
        "grad_rel_diff": grad_diff / grad_scale,
        "same_keys": sorted(run["grads"]) == sorted(ref["grads"]),
        "grad_dtypes": sorted({str(g.dtype) for g in run["grads"].values()}),
    }


def reference(moe: bool, **model_kw: Any) -> dict[str, Any]:
    ids, labels = global_batch()
    return train(build_model(model_config(moe, **model_kw), VOCAB), None, ids, labels)


def parallel_run(
    ctx: DistContext,
    parallel: dict[str, Any],
    moe: bool,
    per_rank_mean: bool = False,
    **model_kw: Any,
):
    """Build, apply the plan, train on this rank's rows of the global batch; returns (model, plan, result)."""
    cfg = model_config(moe, **model_kw)
    plan = build_parallel_plan(ParallelConfig(**parallel), ctx, cfg.num_experts)
    # As in the trainer: ranks other than 0 build on meta, the plan fills them from rank 0.
    model = plan.apply(build_model(cfg, VOCAB, on_meta=not ctx.is_main))
    ids, labels = global_batch()
    rows = GLOBAL_BATCH // plan.dp_size
    mine = slice(plan.dp_rank * rows, (plan.dp_rank + 1) * rows)
    return model, plan, train(model, plan, ids[mine], labels[mine], per_rank_mean)


def equivalence_checks(
    ctx: DistContext, out: Path, cases: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Each case: {"parallel": ParallelConfig kwargs, "moe": bool, optional "per_rank_mean", "model_kw", "save"}."""
    results: dict[str, Any] = {}
    refs: dict[tuple, dict[str, Any]] = {}
    for name, case in cases.items():
        model_kw = case.get("model_kw", {})
        model, plan, run = parallel_run(
            ctx, case["parallel"], case["moe"], case.get("per_rank_mean", False), **model_kw
        )
        if case.get("save"):
            save_model(model, out)
        if ctx.is_main:
            key = (case["moe"], tuple(sorted(model_kw.items())))
            if key not in refs:
                refs[key] = reference(case["moe"], **model_kw)
            results[name] = compare(run, refs[key])
            results[name]["layout"] = plan.layout_metadata().to_json()
            results[name]["dp_ranks"] = None
        ranks = [torch.zeros((), dtype=torch.long) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(ranks, torch.tensor(plan.dp_rank))
        if ctx.is_main:
            results[name]["dp_ranks"] = [int(r) for r in ranks]
    return results


def init_checks(ctx: DistContext, out: Path, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ranks > 0 build on meta; the sharded model must equal a single-process build bitwise.

    Rank 0 compares the gathered full state dict; every rank compares its own buffers
    (non-persistent rotary tables are not in the state dict). A ``from_path`` case
    loads a local HF directory (``model.path``) that rank 0 wrote first.
    """
    results: dict[str, Any] = {}
    for name, case in cases.items():
        cfg = model_config(case["moe"], **case.get("model_kw", {}))
        if case.get("from_path"):
            path = out / f"hf_{name}"
            if ctx.is_main:
                build_model(replace(cfg, init_seed=5), VOCAB).save_pretrained(path)
            torch.distributed.barrier()
            cfg = replace(cfg, path=str(path))
        plan = build_parallel_plan(ParallelConfig(**case["parallel"]), ctx, cfg.num_experts)
        built = build_model(cfg, VOCAB, on_meta=not ctx.is_main)
        was_meta = all(p.is_meta for p in built.parameters())
        model = plan.apply(built)
        gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        reference = build_model(cfg, VOCAB).to(ctx.device)
        ref_buffers = dict(reference.named_buffers())
        bad_buffers = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
        counts = torch.tensor([len(bad_buffers), int(was_meta)])
        torch.distributed.all_reduce(counts)
        if ctx.is_main:
            ref_state = reference.state_dict()
            results[name] = {
                "same_keys": sorted(gathered) == sorted(ref_state),
                "mismatched": sorted(
                    k for k in ref_state if not torch.equal(full(gathered[k]), ref_state[k])
                ),
                "ranks_with_bad_buffers": int(counts[0]),
                "meta_ranks": int(counts[1]),
            }
    return results


def save_model(model: nn.Module, out: Path) -> None:
    """DCP-save the sharded model; rank 0 also writes the full tensors for bitwise comparison."""
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=out / DCP_DIR)
    full_state = {k: full(v).detach().clone() for k, v in state.items()}
    if torch.distributed.get_rank() == 0:
        torch.save(full_state, out / FULL_STATE_FILE)


def load_checks(
    ctx: DistContext, out: Path, ckpt: str, cases: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Load the DCP checkpoint at ``ckpt`` under each case's layout; report keys and bitwise equality."""
    expected = torch.load(Path(ckpt) / FULL_STATE_FILE, weights_only=True)
    results = {}
    for name, case in cases.items():
        cfg = model_config(True)
        plan = build_parallel_plan(ParallelConfig(**case["parallel"]), ctx, cfg.num_experts)
        model = plan.apply(build_model(replace(cfg, init_seed=99), VOCAB))
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=Path(ckpt) / DCP_DIR)
        set_model_state_dict(model, state)
        loaded = {k: full(v) for k, v in get_model_state_dict(model).items()}
        results[name] = {
            "same_keys": sorted(loaded) == sorted(expected),
            "mismatched": sorted(
                k for k in expected if k in loaded and not torch.equal(loaded[k], expected[k])
            ),
        }
    return results
