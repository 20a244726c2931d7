"""``model.activation_checkpointing``: the same losses and gradients, bit for bit, in less memory.

FP32 throughout (``model.dtype=fp32``, ``parallel.param_dtype=fp32``); every comparison is
``torch.equal``: the recompute runs the same kernels on the same inputs with the RNG state
restored, so nothing may differ. Dropout is on (attention dropout and LoRA dropout) so
the RNG handling is exercised; the negative controls show the comparison does fail when
the weights differ or the recompute draws new dropout masks. The 2-rank cases run
FSDP2 (dense) and ep=2 (MoE, with and without LoRA on the experts) in one spawn.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.distributed.workers_ac import (
    DENSE,
    LORA,
    LORA_EXPERTS,
    MOE,
    QWEN2_MOE,
    VOCAB,
    ac_suite,
    batch,
    run_case,
)
from veoptim.errors import ConfigError
from veoptim.models.activation_checkpointing import enable_activation_checkpointing
from veoptim.models.build import build_model

pytestmark = pytest.mark.slow

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32"}
SINGLE_CASES: dict[str, dict[str, Any]] = {
    "dense_dropout": {"model": DENSE},
    "qwen3_moe": {"model": MOE},
    "qwen2_moe": {"model": QWEN2_MOE},
    "dense_lora_dropout": {"model": DENSE, "lora": LORA},
    "moe_lora_experts": {"model": MOE, "lora": LORA_EXPERTS},
}
TWO_RANK_CASES: dict[str, dict[str, Any]] = {
    "dense_fsdp2": {"model": DENSE, "parallel": FP32},
    "moe_ep2": {"model": MOE, "parallel": {"ep": 2, **FP32}},
    "moe_ep2_lora_experts": {"model": MOE, "lora": LORA_EXPERTS, "parallel": {"ep": 2, **FP32}},
    "control_dense_fsdp2_seed": {"model": DENSE, "parallel": FP32, "control": "seed"},
}


def assert_bitwise_equal(result: dict[str, Any]) -> None:
    assert result["checkpointed_layers"] == DENSE.num_hidden_layers, result
    assert result["same_keys"], result
    assert result["num_grads"] > 0
    assert result["losses_equal"] and result["unequal_grads"] == [], result


@pytest.mark.parametrize("case", sorted(SINGLE_CASES))
def test_one_process_losses_and_gradients_are_bitwise_equal(case: str) -> None:
    assert_bitwise_equal(run_case(SINGLE_CASES[case], plan=None))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(2, ac_suite, tmp_path_factory.mktemp("ac_two_ranks"), TWO_RANK_CASES)


@pytest.mark.parametrize("case", ["dense_fsdp2", "moe_ep2", "moe_ep2_lora_experts"])
def test_two_ranks_losses_and_gradients_are_bitwise_equal(two_ranks, case: str) -> None:
    result = two_ranks[case]
    assert_bitwise_equal(result)
    if case.startswith("moe"):
        assert result["layout"]["ep_size"] == 2


def test_two_rank_negative_control_other_weights_differ(two_ranks) -> None:
    result = two_ranks["control_dense_fsdp2_seed"]
    assert result["same_keys"] and not result["losses_equal"], result
    assert len(result["unequal_grads"]) == result["num_grads"], result


def test_negative_control_recompute_without_rng_restore_differs() -> None:
    """With new dropout masks in the recompute the gradients change: RNG handling matters,
    and the bitwise comparison sees it (the first loss still agrees: same forward)."""
    result = run_case({"model": DENSE, "control": "no_rng_restore"}, plan=None)
    assert result["same_keys"] and result["unequal_grads"], result
    dropout_free = run_case(
        {"model": replace(DENSE, attention_dropout=0.0), "control": "no_rng_restore"}, plan=None
    )
    assert dropout_free["unequal_grads"] == [], dropout_free  # only dropout draws from the RNG


def test_state_dict_and_parameter_names_are_unchanged() -> None:
    """Checkpoints and exports of either setting load into the other: the same names."""
    for cfg in (DENSE, MOE):
        plain = build_model(cfg, VOCAB)
        checkpointed = build_model(replace(cfg, activation_checkpointing=True), VOCAB)
        assert list(plain.state_dict()) == list(checkpointed.state_dict())
        assert [n for n, _ in plain.named_parameters()] == [
            n for n, _ in checkpointed.named_parameters()
        ]
        assert type(plain.model.layers[0]) is type(checkpointed.model.layers[0])


def mlp_calls(model: torch.nn.Module) -> int:
    """Forward calls of every decoder layer's MLP during one forward and backward (counted
    on entry: the recompute stops early, once it has rebuilt the last saved tensor)."""
    calls = [0]
    handles = [
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for layer in model.model.layers
    ]
    ids, _ = batch()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    for handle in handles:
        handle.remove()
    return calls[0]


def test_layers_are_recomputed_in_training_only() -> None:
    """Each layer runs twice per step (forward, then the recompute) in training mode, once in
    eval mode (DPO's frozen reference); the embedding output is not forced to need grad."""
    layers = DENSE.num_hidden_layers
    assert mlp_calls(build_model(DENSE, VOCAB).train()) == layers
    checkpointed = build_model(replace(DENSE, activation_checkpointing=True), VOCAB)
    assert mlp_calls(checkpointed.train()) == 2 * layers
    assert mlp_calls(checkpointed.eval()) == layers
    checkpointed.requires_grad_(False)
    embeds = checkpointed.model.embed_tokens(batch()[0])
    assert not embeds.requires_grad


def test_model_without_support_is_refused() -> None:
    model = build_model(DENSE, VOCAB)
    model.supports_gradient_checkpointing = False
    with pytest.raises(ConfigError, match="does not support activation checkpointing"):
        enable_activation_checkpointing(model)


def test_config_key_reaches_the_model(tmp_path: Path) -> None:
    """Built from config and loaded from model.path alike (on meta too)."""
    from veoptim.models.activation_checkpointing import checkpointed_layers

    build_model(DENSE, VOCAB).save_pretrained(tmp_path)
    cfg = replace(DENSE, path=str(tmp_path), activation_checkpointing=True)
    assert checkpointed_layers(build_model(cfg, VOCAB)) == DENSE.num_hidden_layers
    assert checkpointed_layers(build_model(cfg, VOCAB, on_meta=True)) == DENSE.num_hidden_layers
    assert checkpointed_layers(build_model(DENSE, VOCAB)) == 0
