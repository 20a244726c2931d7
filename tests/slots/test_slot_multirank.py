"""Slots on 2 gloo ranks with FSDP2: a slot with rows on one rank only, exact continuation
through save and load into another slot, slot-local loads, the negative controls, and
optimizer state refused under another layout or world size (weights still load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.slots.helpers import batch, build, differences
from veoptim.distributed import DistContext
from veoptim.errors import SlotError

pytestmark = pytest.mark.slow

K = 3


def step_alone(trainer, slot: int, rows: list[int]) -> None:
    trainer.forward_backward(batch(rows, [slot] * len(rows)))
    trainer.optim_step(slot)


def _checks(ctx: DistContext, out: Path) -> dict:
    rank = ctx.rank
    trainer = build(out / "run", ctx, **{"parallel.dp_shard": 2})
    for slot in range(3):
        trainer.create_slot(slot)
    for step in range(K):  # slot 0 has rows on rank 0 only, slot 2 on rank 1 only
        first = 100 * step + 10 * rank
        trainer.train_step(
            batch([first, first + 1, first + 2], [0, 1, 0] if rank == 0 else [1, 2, 2])
        )
    trainer.save_slot(0, "alice")
    others = {s: trainer.slot_state(s) for s in (1, 2)}
    saved = trainer.slot_state(0)
    trainer.load_slot(3, "alice")
    result = {
        "sharded": type(trainer.slots[0].params.named[0][1]).__name__,
        "loaded_equal": differences(saved, trainer.slot_state(3)),
        "others_unchanged": [differences(others[s], trainer.slot_state(s)) for s in (1, 2)],
        "masters_differ": any(
            not torch.equal(saved["master_weight"][n], w.float())
            for n, w in saved["weights"].items()
        ),
    }
    step_alone(trainer, 0, [500 + rank])
    step_alone(trainer, 3, [500 + rank])
    result["after_step"] = differences(trainer.slot_state(0), trainer.slot_state(3))
    result["steps"] = trainer.slot_state(3)["steps"]
    # Negative controls: BF16-rounded masters, and a weights-only load.
    optimizer = trainer.slots[3].optimizer.optimizer
    with torch.no_grad():
        for param in trainer.slots[3].params.parameters():
            master = optimizer.state[param]["master_weight"]
            master._local_tensor.copy_(master._local_tensor.to(torch.bfloat16).float())
    result["rounded_caught"] = differences(trainer.slot_state(0), trainer.slot_state(3))
    trainer.load_slot(3, "alice", load_optimizer=False)
    result["weights_only_caught"] = differences(saved, trainer.slot_state(3))
    # Another layout on the same world size: optimizer state refused, weights load.
    replicated = build(
        out / "replicated",
        ctx,
        **{"parallel.dp_shard": 1, "parallel.dp_replicate": 2,
           "checkpoint.root": str(trainer.store.root.parent)},
    )  # fmt: skip
    replicated.create_slot(1)
    before = replicated.slot_state(1)
    try:
        replicated.load_slot(1, "alice")
        result["layout_refused"] = ""
    except SlotError as exc:
        result["layout_refused"] = str(exc)
    result["layout_unchanged"] = differences(before, replicated.slot_state(1))
    replicated.load_slot(1, "alice", load_optimizer=False)
    weights = replicated.slot_state(1)["weights"]
    result["weights_resharded"] = all(
        torch.equal(w, saved["weights"][n]) for n, w in weights.items()
    )

    # A save failing on rank 1 only: every rank raises that slot's error, nothing changes,
    # and the other slots train on.
    def disk_full_on_rank_1(phase: str) -> None:
        if phase == "written" and rank == 1:
            raise OSError(28, "No space left on device")

    before = {s: trainer.slot_state(s) for s in (1, 2)}
    trainer.store.fault_hook = disk_full_on_rank_1
    try:
        trainer.save_slot(1, "bob")
        result["save_fault"] = ""
    except SlotError as exc:
        result["save_fault"] = f"{exc.slot}: {exc}"
    trainer.store.fault_hook = None
    result["fault_unchanged"] = [differences(before[s], trainer.slot_state(s)) for s in (1, 2)]
    trainer.train_step(batch([700 + rank, 710 + rank], [1, 2]))
    result["trained_after_fault"] = trainer.slot_state(2)["steps"]
    if rank == 0:
        torch.save(saved, out / "saved.pt")
    return result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("slots2")
    return run_ranks(2, _checks, out), out


def test_exact_continuation_on_two_ranks(two_ranks):
    result, _ = two_ranks
    assert result["sharded"] == "DTensor" and result["masters_differ"]
    assert result["loaded_equal"] == [] and result["after_step"] == []
    assert result["steps"] == K + 1
    assert result["others_unchanged"] == [[], []]


def test_negative_controls_on_two_ranks(two_ranks):
    result, _ = two_ranks
    assert result["rounded_caught"]
    assert all(d.startswith("master_weight.") for d in result["rounded_caught"])
    assert "steps" in result["weights_only_caught"]


def test_a_save_failing_on_one_rank_is_that_slots_error_on_every_rank(two_ranks):
    result, _ = two_ranks
    assert result["save_fault"].startswith("1: slot 1: saving it as 'bob' failed")
    assert "No space left on device" in result["save_fault"]
    assert result["fault_unchanged"] == [[], []] and result["trained_after_fault"] == K + 1


def test_other_layout_refuses_optimizer_state_but_loads_weights(two_ranks):
    result, _ = two_ranks
    assert "layout dp_replicate=2 x efsdp=1 x ep=1" in result["layout_refused"]
    assert result["layout_unchanged"] == [] and result["weights_resharded"]


def test_two_rank_save_in_one_process(two_ranks, tmp_path):
    _, out = two_ranks
    saved = torch.load(out / "saved.pt")
    trainer = build(tmp_path, **{"checkpoint.root": str(out / "run" / "checkpoints")})
    trainer.create_slot(1)
    before = trainer.slot_state(1)
    with pytest.raises(SlotError, match="saved on 2 ranks.*this trainer runs 1 ranks"):
        trainer.load_slot(1, "alice")
    assert differences(before, trainer.slot_state(1)) == []
    trainer.load_slot(1, "alice", load_optimizer=False)
    weights = trainer.slot_state(1)["weights"]
    assert all(torch.equal(w, saved["weights"][n]) for n, w in weights.items())
