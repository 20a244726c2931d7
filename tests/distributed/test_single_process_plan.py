"""The parallel plan in one process: no mesh, the model unchanged, the trainer's calls still work."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.workers import (
    MAX_NORM,
    VOCAB,
    global_batch,
    loss_tokens,
    model_config,
    token_loss_sum,
)
from veoptim.config.schema import ParallelConfig
from veoptim.distributed import build_parallel_plan, init_distributed
from veoptim.distributed.grad_norm import clip_grad_norm_
from veoptim.errors import ConfigError, DistributedError
from veoptim.models.build import build_model


@pytest.fixture
def ctx():
    context = init_distributed("cpu", "auto", {})
    yield context
    context.close()


def test_single_process_plan_has_no_mesh_and_one_data_shard(ctx):
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=0)
    assert plan.meshes is None
    assert (plan.dp_rank, plan.dp_size) == (0, 1)


def test_apply_returns_the_same_model_unchanged(ctx):
    model = build_model(model_config(moe=True), VOCAB)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=4)
    assert plan.apply(model) is model
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_all_reduce_sum_is_identity_and_does_not_alias(ctx):
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=0)
    x = torch.tensor([3.0, 4.0])
    y = plan.all_reduce_sum(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_clip_grad_norm_matches_torch_in_one_process(ctx):
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=0)
    ids, labels = global_batch()
    models = [plan.apply(build_model(model_config(moe=False), VOCAB)) for _ in range(2)]
    for model in models:
        (token_loss_sum(model, ids, labels) / loss_tokens(labels)).backward()
    ours = plan.clip_grad_norm_(models[0], MAX_NORM)
    theirs = torch.nn.utils.clip_grad_norm_(models[1].parameters(), MAX_NORM)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def test_clip_grad_norm_with_inf_max_norm_only_measures(ctx):
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=0)
    model = build_model(model_config(moe=False), VOCAB)
    ids, labels = global_batch()
    token_loss_sum(model, ids, labels).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = plan.clip_grad_norm_(model, float("inf"))
    assert norm > MAX_NORM
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


@pytest.mark.parametrize("max_norm", [MAX_NORM, float("inf")])
def test_clip_grad_norm_folds_a_scale_into_its_multiply(max_norm):
    """Loss-sum gradients with ``scale=1/tokens``: the norm and gradients of the mean."""
    ids, labels = global_batch()
    models = [build_model(model_config(moe=False), VOCAB) for _ in range(2)]
    tokens = loss_tokens(labels)
    token_loss_sum(models[0], ids, labels).backward()
    (token_loss_sum(models[1], ids, labels) / tokens).backward()
    ours = clip_grad_norm_(models[0].parameters(), max_norm, scale=1.0 / tokens)
    theirs = clip_grad_norm_(models[1].parameters(), max_norm)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    assert ours > MAX_NORM  # the clip applies
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)  # rounding order


def test_moe_with_ep1_trains_in_one_process(ctx):
    plan = build_parallel_plan(ParallelConfig(ep=1), ctx, num_experts=4)
    model = plan.apply(build_model(model_config(moe=True), VOCAB))
    ids, labels = global_batch()
    loss = token_loss_sum(model, ids, labels) / loss_tokens(labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_single_process_layout_metadata(ctx):
    layout = build_parallel_plan(ParallelConfig(), ctx, num_experts=4).layout_metadata()
    assert layout.mesh_dim_sizes == (1, 1, 1)
    assert (layout.world_size, layout.ep_size, layout.expert_placement) == (1, 1, ((0, 1, 2, 3),))


@pytest.mark.parametrize("key", ["param_dtype", "reduce_dtype"])
def test_unknown_mixed_precision_dtype_is_rejected(ctx, key):
    with pytest.raises(ConfigError, match=f"parallel.{key} must be one of"):
        build_parallel_plan(ParallelConfig(**{key: "fp8"}), ctx, num_experts=0)


def test_a_meta_model_in_one_process_is_rejected(ctx):
    """Only ranks > 0 may build on meta: one process has no rank 0 to fill it from."""
    model = build_model(model_config(moe=False), VOCAB, on_meta=True)
    assert all(p.is_meta for p in model.parameters())
    plan = build_parallel_plan(ParallelConfig(), ctx, num_experts=0)
    with pytest.raises(DistributedError, match="meta device"):
        plan.apply(model)
