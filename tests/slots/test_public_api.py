"""The public calls of ``veoptim.slots``, one by one, through the package's own names: a
slot created, given rows and freed; ``save_slot`` / ``load_slot`` round trips, bitwise;
the messages of the refusals."""

from __future__ import annotations

import importlib
import re
import threading

import pytest
import torch

import veoptim.slots as slots_pkg
from tests.slots.helpers import batch, build, differences, train
from veoptim.errors import CheckpointError, DataError, SlotError
from veoptim.slots import (
    SLOT_IDS,
    TARGET_TOKENS,
    SlotLoss,
    TokenPass,
    forward_tokens,
    optim_step_clipped,
)


@pytest.fixture
def trainer(tmp_path):
    trainer = build(tmp_path)
    yield trainer
    trainer.close()


def token_batch(rows: list[int], slots: list[int]) -> dict[str, torch.Tensor]:
    """``batch`` as a per-token pass takes it: each position's target is the next token."""
    plain = batch(rows, slots)
    ids = plain["input_ids"]
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    return {"input_ids": ids, "attention_mask": plain["attention_mask"],
            TARGET_TOKENS: targets, SLOT_IDS: plain[SLOT_IDS]}  # fmt: skip


def summed(logprobs: torch.Tensor, _batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return -logprobs.sum(dim=1)


def test_every_public_name_resolves_to_its_submodule():
    for name in slots_pkg.__all__:
        value = getattr(slots_pkg, name)
        module = slots_pkg._EXPORTS.get(name, "config")
        assert value is getattr(importlib.import_module(f"veoptim.slots.{module}"), name), name
    assert set(slots_pkg.__all__) <= set(dir(slots_pkg))


def test_a_slot_is_created_given_rows_and_freed(trainer):
    assert not trainer.holds(0) and not trainer.partly_written(0)
    trainer.create_slot(0, r=4, seed=3)
    assert trainer.holds(0) and not trainer.partly_written(0) and not trainer.holds(1)
    trainer.check_slot(0)
    params = trainer.slot_parameters(0)
    assert params and all(p.grad is None for p in params)

    rows = batch([0, 1, 2], [0, 0, 0])
    assert trainer.batch_slot_ids(rows).tolist() == [0, 0, 0]
    assert trainer.present_slots(trainer.batch_slot_ids(rows)) == [0]
    losses = trainer.forward_backward(rows)
    assert list(losses) == [0] and isinstance(losses[0], SlotLoss)
    assert losses[0].rows == 3 and losses[0].tokens > 0
    assert all(p.grad is not None for p in params)
    assert trainer.optim_step(0)["step"] == 1

    trainer.release_slot(0)
    assert not trainer.holds(0)
    assert all(p.grad is None and not p.any() for p in params)
    with pytest.raises(SlotError, match=r"^slot 0: does not exist; create_slot or load_slot"):
        trainer.check_slot(0)


def test_a_token_pass_trains_only_its_train_slots_and_steps_the_sum(trainer):
    trainer.create_slot(0)
    trainer.create_slot(1)
    rows = token_batch([0, 1], [0, 1])
    out = forward_tokens(trainer, rows, summed, backward=True, train_slots={0})
    assert isinstance(out, TokenPass)
    assert out.logprobs.shape == rows["input_ids"].shape and out.row_losses.shape == (2,)
    assert all(p.grad is not None for p in trainer.slot_parameters(0))
    assert all(p.grad is None for p in trainer.slot_parameters(1))
    assert optim_step_clipped(trainer, 0, 0.0)["step"] == 1
    with pytest.raises(SlotError, match="slot 1: has no accumulated gradients"):
        trainer.optim_step(1)
    with trainer.lock, trainer.lock:  # re-entrant: a caller may hold it around its calls
        assert forward_tokens(trainer, rows).row_losses.tolist() == [0.0, 0.0]


def test_save_slot_then_load_slot_is_bitwise(trainer):
    trainer.create_slot(0)
    train(trainer, 2, [0])
    saved = trainer.slot_state(0)
    path = trainer.save_slot(0, "alice")
    assert path.is_dir()
    assert trainer.load_slot(1, "alice") == path
    assert differences(saved, trainer.slot_state(1)) == []
    assert trainer.load_slot(2, path) == path  # the returned path loads the same save
    assert differences(saved, trainer.slot_state(2)) == []


def test_a_weights_only_round_trip_keeps_the_weights_bitwise_and_a_fresh_optimizer(trainer):
    trainer.create_slot(0)
    train(trainer, 2, [0])
    saved = trainer.slot_state(0)
    trainer.save_slot(0, "weights", with_optimizer=False)
    trainer.load_slot(1, "weights", load_optimizer=False)
    loaded = trainer.slot_state(1)
    assert loaded["steps"] == 0 and loaded["exp_avg"] == {}
    assert saved["weights"].keys() == loaded["weights"].keys()
    for name, weight in saved["weights"].items():
        assert weight.dtype == loaded["weights"][name].dtype
        assert torch.equal(weight, loaded["weights"][name]), name


def test_the_refusals_say_what_to_do(trainer):
    trainer.create_slot(0)
    refusals = [
        (lambda: trainer.create_slot(0), SlotError,
         "slot 0: already exists; reset_slot or release_slot it first."),
        (lambda: trainer.create_slot(4), SlotError,
         "slot 4: is not a slot index in [0, 4) (lora.num_slots)."),
        (lambda: trainer.create_slot(1, rank=2), SlotError, "slot 1: unknown hyperparameters ['rank']"),
        (lambda: trainer.save_slot(1, "bob"), SlotError,
         "slot 1: does not exist; create_slot or load_slot it first."),
        (lambda: trainer.optim_step(0), SlotError,
         "slot 0: has no accumulated gradients; call forward_backward"),
        (lambda: trainer.load_slot(1, "nobody"), SlotError, "slot 1: "),
        (lambda: trainer.save_slot(0, "../out"), SlotError, "slot 0: saving it as '../out' failed"),
        (lambda: trainer.batch_slot_ids({"input_ids": torch.zeros(1, 2)}), DataError,
         "a slot batch needs 'input_ids', 'labels' and 'slot_ids'"),
        (lambda: forward_tokens(trainer, token_batch([0], [0]), backward=True), ValueError,
         "a backward pass needs a loss_fn"),
        (lambda: optim_step_clipped(trainer, 0, -1.0), SlotError,
         "slot 0: grad_clip must be >= 0 (0 = no clipping), got -1.0."),
    ]  # fmt: skip
    for call, kind, message in refusals:
        with pytest.raises(kind, match="^" + re.escape(message)):
            call()
    trainer.save_slot(0, "weights", with_optimizer=False)
    with pytest.raises(SlotError, match=r"sampler checkpoint .*load_optimizer=False"):
        trainer.load_slot(1, "weights")
    assert not trainer.holds(1)  # a refused load takes no slot


def test_a_missing_checkpoint_is_a_slot_error_caused_by_the_store(trainer):
    with pytest.raises(SlotError) as info:
        trainer.load_slot(2, "nobody")
    assert info.value.slot == 2 and isinstance(info.value.__cause__, CheckpointError)


def test_the_lock_holds_other_threads_calls(trainer):
    """While a caller holds ``lock``, another thread's call waits for it."""
    done = threading.Event()
    with trainer.lock:
        worker = threading.Thread(target=lambda: (trainer.create_slot(3), done.set()))
        worker.start()
        assert not done.wait(0.3) and not trainer.holds(3)
    worker.join(30)
    assert done.is_set() and trainer.holds(3)
