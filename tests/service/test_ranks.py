"""The service's trainer calls on 2 gloo ranks (``ServedTrainer``): rank 0 calls, rank 1
follows. A call's rows are split between the ranks, a rank without rows takes part with
a padding row that adds exact zeros, a failure on either rank is the call's error on rank
0 and the next call runs, and the results equal one process's: a one-row step bit for
bit (rank 1's share of the gradient is exact zeros), sampling token for token. An export
after a forward without backward writes the adapter's values (FSDP had left the
parameters gathered)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.spawn import run_ranks
from tests.service.helpers import differences
from tests.slots.helpers import batch, build
from veoptim.distributed import DistContext
from veoptim.errors import SlotError
from veoptim.service import ranks
from veoptim.service.errors import USER, ServiceError
from veoptim.service.losses import get_loss
from veoptim.slots import SLOT_IDS
from veoptim.slots.tokens import TARGET_TOKENS, SampleRow

pytestmark = [pytest.mark.slow, pytest.mark.multirank]
CROSS_ENTROPY = get_loss("cross_entropy", {})


def fails_on_rank_1(trainer, rank: int, world: int, /) -> None:
    if rank == 1:
        raise SlotError(2, "refused on this rank only")


def token_batch(rows: list[int], slots: list[int]) -> dict[str, torch.Tensor]:
    """Bundled examples as a per-token batch: each position predicts the next token."""
    b = batch(rows, slots)
    ids = b["input_ids"]
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = 0
    weights = (b["labels"] != -100).float()
    return {"input_ids": ids, "attention_mask": b["attention_mask"], SLOT_IDS: b[SLOT_IDS],
            TARGET_TOKENS: targets, "weights": weights}  # fmt: skip


def prompts() -> list[SampleRow]:
    return [SampleRow([1, 2, 3, 4], 0, 5, temperature=0.0),
            SampleRow([5, 6, 7], 0, 5, temperature=1.0,
                      generator=torch.Generator().manual_seed(4)),
            SampleRow([9, 8], 0, 3, temperature=0.0, prompt_logprobs=True)]  # fmt: skip


def sample(served, rows, between=lambda: None, seconds: float | None = None) -> list:
    """A generation of ``rows`` two decode steps at a time (or one step, the time being
    up at once on rank 0's clock: ``seconds=0``), ``between()`` after each."""
    served.start_sampling(rows)
    while not served.advance_sampling(None if seconds is not None else 2, seconds):
        between()
    return served.sampled()


def calls(served, out: Path) -> dict:
    """What rank 0 asks of the (served) trainer; the same on one process for reference."""
    served.create_slot(0, r=4, seed=5)
    one_row = token_batch([0], [0])
    forward = served.forward_tokens(one_row, CROSS_ENTROPY, backward=False)
    export = served.export_slot(0, "after_forward")
    step = served.forward_tokens(one_row, CROSS_ENTROPY, backward=True)
    metrics = served.optim_step(0, 0.0, lr=1e-2)
    mixed = served.forward_tokens(token_batch([1, 2, 3], [0, 0, 0]), CROSS_ENTROPY, False)
    sampled = sample(served, prompts(), between=lambda: served.forward_tokens(
        one_row, CROSS_ENTROPY, backward=False))  # fmt: skip
    alone = sample(served, prompts()[:1], seconds=0.0)  # one row: rank 1 pads
    torch.save({"forward": forward.logprobs, "step": step.row_losses, "mixed": mixed.logprobs,
                "state": served.slot_state(0),
                "sampled": [(s.tokens, s.logprobs, s.prompt_logprobs) for s in sampled],
                "alone": [s.tokens for s in alone],
                "export": {k: v for k, v in load_file(export / "adapter_model.safetensors").items()}},
               out / "results.pt")  # fmt: skip
    return {"grad_norm": metrics["grad_norm"]}


def _worker(ctx: DistContext, out: Path) -> dict:
    ranks.CALLS["fails_on_rank_1"] = fails_on_rank_1
    served = ranks.ServedTrainer(build(out / "run", ctx, **{"parallel.dp_shard": 2}), 120)
    if ctx.rank != 0:
        served.follow()
        return {}
    result = calls(served, out)
    try:
        served._everywhere("fails_on_rank_1")
    except ServiceError as exc:
        result["other_rank"] = [exc.message, exc.category]
    try:
        served.create_slot(0)  # exists: fails on every rank, rank 0 raises its own error
    except SlotError as exc:
        result["own"] = str(exc)
    result["after_errors"] = served.forward_tokens(
        token_batch([4], [0]), CROSS_ENTROPY, False
    ).logprobs.shape[0]
    served.stop_followers()
    return result


@functools.cache
def _results() -> tuple[dict, dict, dict, dict]:
    out = Path(tempfile.mkdtemp(prefix="veoptim-served-"))
    two = run_ranks(2, _worker, out, timeout_s=600)
    one_dir = out / "one"
    one_dir.mkdir()
    trainer = build(one_dir / "run")
    try:
        one = calls(ranks.ServedTrainer(trainer, 120), one_dir)
    finally:
        trainer.close()
    return two, torch.load(out / "results.pt"), one, torch.load(one_dir / "results.pt")


def test_a_one_row_step_on_two_ranks_equals_one_process_bitwise():
    two, got, one, want = _results()
    assert torch.equal(got["forward"], want["forward"])
    assert torch.equal(got["step"], want["step"])
    # The reported norm is a BF16 sum of squares, over shards on 2 ranks: the same to the
    # rounding of BF16 (the step itself, unclipped, is bitwise the same).
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=2**-6)
    assert differences(got["state"], want["state"]) == []


def test_rows_split_between_the_ranks_give_one_process_results():
    _, got, _, want = _results()
    torch.testing.assert_close(got["mixed"], want["mixed"], rtol=1e-5, atol=1e-5)
    assert [s[0] for s in got["sampled"]] == [s[0] for s in want["sampled"]]
    assert got["alone"] == want["alone"] == [got["sampled"][0][0]]
    torch.testing.assert_close(got["sampled"][2][2], want["sampled"][2][2], equal_nan=True)


def test_an_export_after_a_forward_holds_the_adapter_not_the_gathered_buffer():
    _, got, _, want = _results()
    assert got["export"].keys() == want["export"].keys()
    assert differences(got["export"], want["export"]) == []


def test_a_failure_on_any_rank_is_the_calls_error_and_the_next_call_runs():
    two, *_ = _results()
    message, category = two["other_rank"]
    assert "refused on this rank only" in message and "(on rank 1)" in message
    assert category == USER
    assert "already exists" in two["own"]
    assert two["after_errors"] == 1
