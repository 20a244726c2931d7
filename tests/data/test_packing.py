"""Packing: rows of exactly max_seq_len whose examples cannot see each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from veoptim.config.schema import ModelConfig
from veoptim.data import IGNORE_INDEX, collate, load_sft_dataset
from veoptim.models.build import build_model

MAX_LEN = 64


@pytest.fixture(scope="module")
def unpacked(tokenizer):
    return load_sft_dataset("", tokenizer, MAX_LEN, packing=False)


@pytest.fixture(scope="module")
def packed(tokenizer):
    return load_sft_dataset("", tokenizer, MAX_LEN, packing=True)


def segments(row: dict) -> list[tuple[int, int]]:
    """(start, end) of each example (and the trailing padding) from the position restarts."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    return list(zip(starts, starts[1:] + [len(row["position_ids"])], strict=True))


def test_packed_rows_are_exactly_max_seq_len_with_restarting_positions(packed, unpacked):
    assert len(packed) < len(unpacked) // 3
    for row in packed:
        assert {len(v) for v in row.values()} == {MAX_LEN}
        for start, end in segments(row):
            assert row["position_ids"][start:end].tolist() == list(range(end - start))


def test_packing_keeps_every_example_in_order(packed, unpacked, tokenizer):
    examples = iter(unpacked)
    for row in packed:
        for start, end in segments(row):
            if row["input_ids"][start] == tokenizer.pad_token_id:
                assert (row["input_ids"][start:] == tokenizer.pad_token_id).all()
                assert (row["labels"][start:] == IGNORE_INDEX).all()
                break
            example = next(examples)
            assert torch.equal(row["input_ids"][start:end], example["input_ids"])
            assert torch.equal(row["labels"][start + 1 : end], example["labels"][1:])
            assert row["labels"][start] == IGNORE_INDEX
    assert next(examples, None) is None


def test_collated_packed_batch_has_position_ids_and_no_attention_mask(packed, tokenizer):
    batch = collate([packed[0], packed[1]], tokenizer.pad_token_id)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (2, MAX_LEN)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-token loss (0 where unlabelled), aligned with the input positions."""
    losses = F.cross_entropy(
        logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return torch.cat([torch.zeros(1), losses])


def packed_and_separate_losses(model, packed, unpacked, tokenizer, **forward):
    """Per-token losses of two collated packed rows, and of the same examples run one by one."""
    batch = collate([packed[0], packed[1]], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), **forward
        ).logits
        packed_losses = [token_losses(logits[r], batch["labels"][r]) for r in range(2)]
        separate, examples = [], iter(unpacked)
        for row in range(2):
            for start, end in segments(packed[row]):
                if packed[row]["input_ids"][start] == tokenizer.pad_token_id:
                    break
                example = next(examples)
                logits_one = model(input_ids=example["input_ids"][None], use_cache=False).logits[0]
                separate.append((row, start, end, token_losses(logits_one, example["labels"])))
    return packed_losses, separate


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_per_token_losses_equal_the_examples_run_separately(
    attn, packed, unpacked, tokenizer
):
    model = build_model(ModelConfig(), len(tokenizer))
    model.config._attn_implementation = attn
    packed_losses, separate = packed_and_separate_losses(
        model, packed, unpacked, tokenizer, use_cache=False
    )
    assert len(separate) > 4
    for row, start, end, losses in separate:
        torch.testing.assert_close(packed_losses[row][start:end], losses, rtol=1e-5, atol=1e-5)
    labelled = sum(int((packed[r]["labels"] != IGNORE_INDEX).sum()) for r in range(2))
    total = sum(float(losses.sum()) for *_, losses in separate)
    assert labelled > 0
    assert abs(sum(float(p.sum()) for p in packed_losses) - total) < 1e-3


def max_packed_vs_separate_gap(model, packed, unpacked, tokenizer, **forward) -> float:
    packed_losses, separate = packed_and_separate_losses(
        model, packed, unpacked, tokenizer, **forward
    )
    return max(float((packed_losses[r][s:e] - losses).abs().max()) for r, s, e, losses in separate)


def test_negative_control_cache_enabled_forward_lets_packed_examples_attend_each_other(
    packed, unpacked, tokenizer
):
    # transformers only derives the block-diagonal mask from position_ids when no KV cache
    # is built, so training forwards must pass use_cache=False.
    model = build_model(ModelConfig(), len(tokenizer))
    assert max_packed_vs_separate_gap(model, packed, unpacked, tokenizer, use_cache=True) > 1e-2
